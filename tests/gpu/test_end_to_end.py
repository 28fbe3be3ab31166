"""Greedy tokens on the GPU (bf16; Triton kernels, CUDA graphs, and FlashInfer where it serves the head
dim, the torch attention otherwise) against the CPU fp32 run, on every architecture."""

from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from tests.models.test_architectures import PROMPTS
from tests.models.tiny import CONFIGS, build

GPU_OPTIONS = {"dtype": "bfloat16", "device": "cuda", "mode": "cudagraph", "kv_cache_gib": 0.05,
               "max_num_seqs": 4, "max_num_batched_tokens": 64}  # fmt: skip


@pytest.mark.parametrize("head_dim", [None, 64, 128], ids=["native", "hd64", "hd128"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_gpu_greedy_tokens_match_cpu_fp32(arch: str, head_dim: int | None, tmp_path: Path) -> None:
    build(arch, tmp_path, head_dim)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(str(tmp_path), dtype="float32", kv_cache_gib=0.01, mode="eager", device="cpu")
    gpu = LLM(str(tmp_path), **GPU_OPTIONS)
    # head dims 16 and 32 are beyond FlashInfer's kernels: auto falls back to the torch attention.
    assert gpu.engine.backend.attention == ("flashinfer" if head_dim else "torch")
    assert gpu.engine.backend.kernels == "triton"
    want = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, params, use_tqdm=False)]
    # bf16 rounds differently from fp32: the first token must agree, the rest is reported.
    assert [g[0] for g in got] == [w[0] for w in want]
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    agreement = same / sum(len(w) for w in want)
    print(f"{arch} head_dim {head_dim or 'native'}: bf16 GPU vs fp32 CPU greedy agreement {agreement:.1%}")
    assert agreement >= 0.5
    assert gpu.engine.runner.lowering.misses == 0
