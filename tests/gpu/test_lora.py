"""LoRA adapters on the GPU (bf16, CUDA graphs, FlashInfer at head dim 128, the torch attention at 16):
greedy tokens of a batch mixing two adapters and the base model against the CPU fp32 run of the same
requests, and nothing compiled after ready."""

from pathlib import Path

import pytest

from kiln import LLM, LoRARequest, SamplingParams
from kiln.compile.reports import compile_counters
from tests.gpu.test_end_to_end import GPU_OPTIONS, assert_greedy_agrees
from tests.models.lora_adapters import save_adapter
from tests.models.test_architectures import PROMPTS
from tests.models.tiny import build


@pytest.mark.parametrize("head_dim", [None, 128], ids=["torch-attention", "flashinfer"])
def test_gpu_adapters_match_cpu_fp32(head_dim: int | None, tmp_path: Path) -> None:
    hf = build("llama", tmp_path / "model", head_dim)
    a = save_adapter(tmp_path / "a", hf, seed=1, rank=8)
    b = save_adapter(tmp_path / "b", hf, seed=2, rank=4, modules=("q_proj", "v_proj", "down_proj"))
    loras = [None, LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))] * len(PROMPTS)
    prompts = [p for p in PROMPTS for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    model = str(tmp_path / "model")
    cpu = LLM(model, dtype="float32", kv_cache_gib=0.01, mode="eager", device="cpu", **lora)
    want = [o.outputs[0] for o in cpu.generate(prompts, params, use_tqdm=False, lora_request=loras)]
    gpu = LLM(model, **(GPU_OPTIONS | {"max_num_seqs": 9, "max_num_batched_tokens": 128}), **lora)
    before = compile_counters()
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False, lora_request=loras)]
    assert compile_counters() == before
    assert gpu.engine.runner.lowering.misses == 0
    assert_greedy_agrees(got, want)
    assert got[0] != got[1] != got[2]  # each adapter changed the tokens
