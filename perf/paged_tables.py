"""The host's part of FlashInfer's plan at a large decode batch: a step's page tables (StepLayout.paged)
from a CUDA graph's block table, which is max_model_len wide, against scanning every column of it (what the
plan did before it cut the table to the step's longest context). Host numpy only: it runs on any machine.

    python perf/paged_tables.py
"""

from __future__ import annotations

import timeit

import numpy as np

from kiln.ops.attention import StepLayout

ROWS, BLOCK = 256, 16


def main() -> None:
    rng = np.random.default_rng(0)
    lens = rng.integers(100, 2048, ROWS).astype(np.int32)  # contexts of 100-2,047 tokens
    for width in (128, 2560):  # max_model_len 2,048 and 40,960
        table = rng.integers(0, 100_000, (ROWS, width)).astype(np.int32)
        layout = StepLayout(np.arange(ROWS + 1, dtype=np.int32), lens, table, decode_only=True, graph=True)

        def full_scan(table: np.ndarray = table) -> np.ndarray:
            pages = np.maximum(1, -(-lens.astype(np.int64) // BLOCK))
            return table[np.arange(table.shape[1])[None, :] < pages[:, None]].astype(np.int32)

        assert (full_scan() == layout.paged(BLOCK)[1]).all()
        for name, f in (("every column", full_scan), ("paged()", lambda layout=layout: layout.paged(BLOCK))):
            ms = min(timeit.repeat(f, number=200, repeat=5)) / 200 * 1e3
            print(f"{ROWS} rows, table {width} blocks wide, {name}: {ms:.3f} ms")


if __name__ == "__main__":
    main()
