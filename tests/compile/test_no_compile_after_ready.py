"""After warmup, no step of any shape compiles a graph: torch's counters are unchanged across a varied
workload (tests/gpu runs the same workload in cudagraph mode)."""

from pathlib import Path

import pytest

from kiln import LLM
from tests.compile.workload import OPTIONS, assert_nothing_compiles_after_ready
from tests.models.tiny import build


# qwen3_moe: a MoE layer's routing and experts, kiln's opaque CPU ops, beside a dense layer's graph.
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_nothing_compiles_after_ready_in_compiled_mode(arch: str, tmp_path: Path) -> None:
    build(arch, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_gib=0.01, mode="compiled", **OPTIONS)
    assert llm.engine.runner.lowering.ready
    assert_nothing_compiles_after_ready(llm)


def test_nothing_compiles_after_ready_with_drafts(tmp_path: Path) -> None:
    """Speculative decoding's steps: decodes of several tokens a request, mixed steps by another name."""
    build("llama", tmp_path)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    llm = LLM(
        str(tmp_path), dtype="float32", kv_cache_gib=0.01, mode="compiled", speculative_config=spec, **OPTIONS
    )
    assert_nothing_compiles_after_ready(llm)
    drafts = llm.engine.drafts
    assert drafts is not None and drafts.num_accepted_tokens > 0
