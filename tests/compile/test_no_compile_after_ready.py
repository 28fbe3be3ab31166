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
