"""Structured output on CUDA: the bitmask filled on the CPU while the GPU runs the forward, applied with
xgrammar's Triton kernel (built during warmup), beside free rows in CUDA-graph decode steps, with no
stream sync in a step."""

import re
from pathlib import Path

import torch

from kiln import LLM, SamplingParams
from kiln.sampling_params import StructuredOutputsParams
from tests.compile.workload import triton_compiles
from tests.models.tiny import build_default_vocab

DATE = r"\d{4}-\d{2}-\d{2}"


def test_constrained_rows_beside_free_ones(tmp_path: Path, default_model_dir: Path) -> None:
    # A random model: only the grammar makes a date. Head dim 64, FlashInfer's: the torch attention (head
    # dim 16) reads its step's lengths on the host, which sync debug mode refuses.
    model = build_default_vocab(tmp_path, default_model_dir, hidden_size=256)
    llm = LLM(str(model), dtype="bfloat16", device="cuda", mode="cudagraph", kv_cache_gib=0.05,
              max_num_seqs=16)  # fmt: skip
    assert llm.engine.backend.attention == "flashinfer"
    so = StructuredOutputsParams(regex=DATE)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, structured_outputs=so) for s in range(6)]
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with triton_compiles() as built:  # xgrammar's kernel, for every count of constrained rows, is warm
        first = llm.generate(["a b c"] * 7, [free, *params], use_tqdm=False)
    assert not built, f"Triton kernels built after ready: {built}"
    # Again with the grammar compiled: a step whose rows are constrained lands the last step's tokens while
    # its forward runs, and nothing in it may synchronize the stream (sync debug mode raises if it does).
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = llm.generate(["a b c"] * 7, [free, *params], use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for outs in (first, again):
        assert len(outs[0].outputs[0].token_ids) == 16  # a free row runs on, unmasked
        for out in outs[1:]:
            assert re.fullmatch(DATE, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    # A grammar at its end ends its request before min_tokens (Grammars.keep_ends): with EOS banned, a
    # complete choice would leave FlashInfer's kernels a row with no token to draw. The rows use every
    # filter; the unseeded ones are drawn together, min-p's mask with min-p off in some.
    choice = StructuredOutputsParams(choice=["2024-01-01", "1999-12-31"])
    ends = [
        SamplingParams(
            temperature=1.0,
            seed=None if s % 2 else s,
            max_tokens=16,
            min_tokens=12,
            top_k=5 if s % 2 else -1,
            min_p=0.1 if s % 3 == 0 else 0.0,
            structured_outputs=choice,
        )
        for s in range(6)
    ]
    for out in llm.generate(["a b c"] * 6, ends, use_tqdm=False):
        assert out.outputs[0].text in choice.choice and out.outputs[0].finish_reason == "stop"
