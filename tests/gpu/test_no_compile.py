"""In cudagraph mode, nothing compiles after ready: torch's counters are unchanged across a varied
workload (the CPU test runs the same workload in compiled mode)."""

from pathlib import Path

import pytest

from kiln import LLM
from tests.compile.workload import OPTIONS, assert_nothing_compiles_after_ready
from tests.models.tiny import build


@pytest.mark.parametrize(
    ("arch", "head_dim", "deterministic"),
    [("qwen3", 16, False), ("qwen3", 128, False), ("qwen3_moe", 128, False), ("qwen3", 128, True)],
    # moe: Triton's grouped GEMM in the graphs; deterministic: Triton's GEMM, the LM head's run eagerly
    ids=["torch-attention", "flashinfer", "flashinfer-moe", "flashinfer-deterministic"],
)
def test_nothing_compiles_after_ready_in_cudagraph_mode(
    arch: str, head_dim: int, deterministic: bool, tmp_path: Path
) -> None:
    build(arch, tmp_path, head_dim if head_dim != 16 else None)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", mode="cudagraph", kv_cache_gib=0.05,
              deterministic=deterministic, **OPTIONS)  # fmt: skip
    assert llm.engine.backend.attention == ("flashinfer" if head_dim == 128 else "torch")
    assert_nothing_compiles_after_ready(llm)


def test_nothing_compiles_after_ready_with_drafts_on_flashinfer(tmp_path: Path) -> None:
    """Speculative decoding's steps (several tokens a request, FlashInfer's prefill path) after warmup."""
    build("qwen3", tmp_path, 128)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", mode="cudagraph", kv_cache_gib=0.05,
              speculative_config=spec, **OPTIONS)  # fmt: skip
    assert_nothing_compiles_after_ready(llm)
    drafts = llm.engine.drafts
    assert drafts is not None and drafts.num_accepted_tokens > 0
