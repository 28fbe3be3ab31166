"""A second start on CUDA loads every graph class its first start traced (the compile cache entry's
precompiled graphs), traces nothing, and generates what the first did: each start in a process of its own
(tests/compile/start.py). They use the session's cache root, where FlashInfer's modules are built (a root
elsewhere would rebuild them: their ninja files name the root)."""

import shutil
from pathlib import Path

import pytest

from kiln.paths import cache_root
from tests.compile import start
from tests.models.tiny import build


@pytest.mark.parametrize("head_dim", [16, 128], ids=["torch-attention", "flashinfer"])
def test_a_precompiled_start_traces_nothing_and_generates_what_the_first_did(
    head_dim: int, tmp_path: Path
) -> None:
    build("llama", tmp_path / "model", head_dim if head_dim != 16 else None)
    cache = cache_root()
    options = {
        "device": "cuda",
        "dtype": "bfloat16",
        "mode": "cudagraph",
        "kv_cache_gib": 0.05,
        "max_num_seqs": 8,
    }
    cold = start.run(tmp_path / "model", cache, **options)
    if set(cold["graphs"].values()) != {"traced"}:  # an entry an earlier run left: trace afresh
        shutil.rmtree(cold["entry"])
        cold = start.run(tmp_path / "model", cache, **options)
    warm = start.run(tmp_path / "model", cache, **options)
    classes = ["decode", "decode-1"] + (["mixed"] if head_dim == 16 else [])
    assert sorted(cold["graphs"]) == sorted(warm["graphs"]) == classes
    assert set(cold["graphs"].values()) == {"traced"} and set(warm["graphs"].values()) == {"loaded"}
    # The torch attention also compiles its own paged decode (for mixed steps' decode rows) with plain
    # torch.compile: each process traces that again (Inductor's cache has its code), and only that.
    nested = cold["counters"]["dynamo_graphs"] - len(classes)
    assert warm["counters"]["dynamo_graphs"] <= nested and (nested == 0) == (head_dim == 128)
    assert warm["counters"]["fxgraph_cache_miss"] == warm["counters"]["autograd_cache_miss"] == 0
    assert warm["tokens"] == cold["tokens"]
