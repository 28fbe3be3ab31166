"""Compiled (every layer under torch.compile, fullgraph) gives eager's greedy tokens, on every tiny
architecture and on the default model, through decode batches of one and several and mixed steps."""

import logging
from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from kiln.compile.reports import compile_counters
from tests.models.test_architectures import PROMPTS
from tests.models.tiny import CONFIGS, build


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_compiled_matches_eager(arch: str, tmp_path: Path) -> None:
    build(arch, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for mode in ("eager", "compiled"):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_gib=0.01, max_num_batched_tokens=32, mode=mode)
        runs[mode] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert runs["compiled"] == runs["eager"]


def test_default_model_compiled_matches_eager(default_model_dir: Path) -> None:
    """float16 weights, float32 compute. In bfloat16 pairs (`auto` on an AVX512-BF16 CPU) Inductor's
    reordered float32 norms and rotary flip some bfloat16 roundings of the kernels' inputs: logprobs then
    differ by up to about 0.1 between the modes (0.002 here), enough to flip a near-tied greedy token."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    runs = {}
    for mode in ("eager", "compiled"):
        llm = LLM(str(default_model_dir), dtype="float16", kv_cache_gib=0.05, max_model_len=256, mode=mode)
        runs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runs[mode + "-1"] = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert runs["compiled"] == runs["eager"]
    assert runs["compiled-1"] == runs["eager-1"] == runs["eager"][0]


def test_decode_steps_beyond_the_buckets_run_the_compiled_graph(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Decode buckets of 1 and 2 but four sequences: batches of 3 and 4 run the decode class's graph (its
    token dim is dynamic), which compiles nothing new and gives eager's tokens."""
    build("llama", tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = dict(dtype="float32", kv_cache_gib=0.01, max_num_seqs=4, max_num_batched_tokens=64)
    prompts = PROMPTS + PROMPTS[:1]
    eager = LLM(str(tmp_path), mode="eager", **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tmp_path), mode="compiled", decode_sizes=[1, 2], **options)
    before = compile_counters()
    with caplog.at_level(logging.WARNING, logger="kiln.compile.lowering"):
        out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in eager]
    assert compile_counters() == before
    assert llm.engine.runner.lowering.misses == 0
    assert not [r for r in caplog.records if "eagerly" in r.getMessage()]
