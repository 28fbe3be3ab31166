"""LoRA adapters against transformers with each adapter merged into its weights, in fp32: mixed in one
batch with the base model, more adapters than slots, ranks below the slots', fused layers (GPT-2's c_attn),
the prefix cache kept apart per adapter, and the refusals."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kiln import LLM, BeamSearchParams, LoRARequest, SamplingParams
from tests.models.lora_adapters import merged, save_adapter
from tests.models.test_architectures import PROMPTS
from tests.models.tiny import build

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
_OPTIONS = dict(dtype="float32", kv_cache_gib=0.01, max_num_batched_tokens=64, enable_lora=True)


def _reference(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_adapters_mixed_in_a_batch_match_merged_weights(arch: str, tmp_path: Path) -> None:
    hf = build(arch, tmp_path / "model")
    modules = (
        ("c_attn", "c_proj", "c_fc")
        if arch == "gpt2"
        else ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    a = save_adapter(tmp_path / "a", hf, seed=1, rank=8, modules=modules)
    b = save_adapter(tmp_path / "b", hf, seed=2, rank=4, alpha=8.0, modules=modules[:2], use_rslora=True)
    llm = LLM(str(tmp_path / "model"), max_loras=2, max_lora_rank=8, **_OPTIONS)
    loras = [None, LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))]
    refs = {None: hf, 1: merged(hf, a), 2: merged(hf, b)}
    prompts = [p for p in PROMPTS for _ in loras]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras * len(PROMPTS))
    got = [o.outputs[0].token_ids for o in outs]
    want = [
        _reference(refs[lora and lora.lora_int_id], p)
        for p, lora in zip(prompts, loras * len(PROMPTS), strict=True)
    ]
    assert got == want
    assert len({tuple(t) for t in got[:3]}) == 3  # each adapter changed the tokens


def test_more_adapters_than_slots_take_turns(tmp_path: Path) -> None:
    hf = build("llama", tmp_path / "model")
    paths = [save_adapter(tmp_path / f"a{i}", hf, seed=i) for i in range(3)]
    llm = LLM(str(tmp_path / "model"), max_loras=1, max_cpu_loras=2, **_OPTIONS)
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    outs = llm.generate([PROMPTS[1]] * 6, GREEDY, use_tqdm=False, lora_request=loras * 2)
    want = [_reference(merged(hf, p), PROMPTS[1]) for p in paths]
    assert [o.outputs[0].token_ids for o in outs] == want * 2


def test_beam_search_runs_with_the_adapter(tmp_path: Path) -> None:
    hf = build("llama", tmp_path / "model")
    a = save_adapter(tmp_path / "a", hf, seed=1)
    llm = LLM(str(tmp_path / "model"), **_OPTIONS)
    params = BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True)
    beams = llm.beam_search([PROMPTS[1]], params, lora_request=LoRARequest("a", 1, str(a)))
    assert beams[0].sequences[0].tokens[len(PROMPTS[1]) :] == _reference(merged(hf, a), PROMPTS[1])


def test_the_prefix_cache_is_kept_apart_per_adapter(tmp_path: Path) -> None:
    hf = build("llama", tmp_path / "model")
    a = save_adapter(tmp_path / "a", hf, seed=1)
    llm = LLM(str(tmp_path / "model"), **_OPTIONS)
    prompt = PROMPTS[2]  # 40 tokens: two full blocks of 16 to reuse
    lora = LoRARequest("a", 1, str(a))
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    adapted = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
    assert adapted.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert base.outputs[0].token_ids == _reference(hf, prompt)
    assert adapted.outputs[0].token_ids == again.outputs[0].token_ids == _reference(merged(hf, a), prompt)


def test_moe_model_takes_attention_adapters(tmp_path: Path) -> None:
    hf = build("mixtral", tmp_path / "model")
    a = save_adapter(tmp_path / "a", hf, seed=1, modules=("q_proj", "v_proj", "o_proj"))
    llm = LLM(str(tmp_path / "model"), **_OPTIONS)
    out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(a)))[0]
    assert out.outputs[0].token_ids == _reference(merged(hf, a), PROMPTS[0])


def test_bad_adapters_are_refused_by_name(tmp_path: Path) -> None:
    hf = build("mixtral", tmp_path / "model")
    llm = LLM(str(tmp_path / "model"), max_lora_rank=8, **_OPTIONS)

    def refused(path: Path, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 9, str(path)))

    refused(tmp_path / "nowhere", "Loading lora bad failed: No adapter found for .*nowhere")
    refused(
        save_adapter(tmp_path / "wide", hf, seed=1, rank=16), "LoRA rank 16 is greater than max_lora_rank 8"
    )
    refused(save_adapter(tmp_path / "dora", hf, seed=1, modules=("q_proj",), use_dora=True), "use_dora True")
    experts = save_adapter(tmp_path / "experts", hf, seed=1, modules=("q_proj",))
    w1 = "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1"
    ab = {f"{w1}.lora_A.weight": torch.zeros(8, 64), f"{w1}.lora_B.weight": torch.zeros(128, 8)}
    save_file(ab, experts / "adapter_model.safetensors")
    refused(experts, r"experts\.0\.w1\.lora_A\.weight adapts no layer kiln serves adapters on")
    save_file({}, experts / "adapter_model.safetensors")
    refused(experts, "adapter_model.safetensors holds no LoRA weights")
    cfg = tmp_path / "dora" / "adapter_config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"use_dora": False}))
    (tmp_path / "dora" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    refused(tmp_path / "dora", "no readable .*adapter_model.safetensors")
    assert not llm.engine.has_unfinished()
    assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == _reference(
        hf, PROMPTS[0]
    )


def test_an_adapter_needs_enable_lora(tmp_path: Path) -> None:
    hf = build("llama", tmp_path / "model")
    a = save_adapter(tmp_path / "a", hf, seed=1)
    llm = LLM(str(tmp_path / "model"), dtype="float32", kv_cache_gib=0.01)
    with pytest.raises(ValueError, match=r"LoRA is not enabled \(--enable-lora\)"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(a)))
