"""CPU paged attention as a decode step meets it: one call per layer over 30 layers, each layer with its
own 36 MB KV cache (the default model's 1 GiB), blocks scattered at random, so K/V come from DRAM. `--hot`
reuses one layer's cache for all 30 (K/V from cache), the way a single-call microbenchmark sees it.

    .venv/bin/python perf/cpu_attention.py [--hot]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kiln.ops.cpu import native

HEADS, KV_HEADS, DIM, BLOCK, BLOCKS, LAYERS = 9, 3, 64, 16, 2912, 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hot", action="store_true")
    args = ap.parse_args()
    native.load()
    caches = [torch.randn(BLOCKS, 2, BLOCK, KV_HEADS, DIM).half() for _ in range(1 if args.hot else LAYERS)]
    for batch, ctx in [(16, 200), (64, 200), (64, 600)]:
        order = list(range(BLOCKS))
        random.Random(0).shuffle(order)
        width = -(-ctx // BLOCK)
        table = torch.tensor(order[: batch * width], dtype=torch.int32).view(batch, width)
        q = torch.randn(batch, HEADS, DIM)
        qsl = torch.arange(0, batch + 1, dtype=torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        times = []
        for _ in range(7):
            clock = time.perf_counter()
            for layer in range(LAYERS):
                cache = caches[layer % len(caches)]
                torch.ops.kiln_cpu.paged_attention(q, cache, qsl, lens, table, DIM**-0.5, 0, False)
            times.append(time.perf_counter() - clock)
        ms = statistics.median(times) * 1e3
        mb = batch * ctx * 2 * KV_HEADS * DIM * 2 * LAYERS / 1e6
        print(f"batch {batch}, context {ctx}: {ms / LAYERS:.3f} ms per layer, {mb / ms:.1f} GB/s of K/V")


if __name__ == "__main__":
    main()
