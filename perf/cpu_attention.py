"""CPU paged attention as a decode step meets it: one call per layer over 30 layers, each layer with its
own 36 MB KV cache (the default model's 1 GiB), blocks scattered at random, so K/V come from DRAM. `--hot`
reuses one layer's cache for all 30 (K/V from cache), the way a single-call microbenchmark sees it.
`--prefill N [N ...]` times a causal prefill of N tokens instead, in calls of `--chunk` tokens (2,048; the
engine's on this CPU are 128, its long_prefill_token_threshold): one layer's calls, times 30. `--dtype` sets
the cache's dtype: by default float16 for decode steps, bfloat16 for prefills; bfloat16 and fp8
(--kv-cache-dtype's fp8_e4m3, fp8_e5m2) keep K and V in pairs where the kernels have AVX512-BF16.
`--block-size` sets the cache's (32, kiln's CPU default: AMX passes need blocks of 32; blocks of 16 take
the AVX512-BF16 kernel).

    .venv/bin/python perf/cpu_attention.py [--hot] [--dtype float16|bfloat16|fp8_e4m3|fp8_e5m2]
    .venv/bin/python perf/cpu_attention.py --prefill 1900 [--chunk 128] [--dtype ...]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kiln.ops.attention import KV_CACHE_DTYPES
from kiln.ops.cpu import native
from kiln.ops.cpu.attention import pair_layout

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30
CACHE_SLOTS = 2912 * 16  # the default model's 1 GiB per layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hot", action="store_true")
    ap.add_argument("--prefill", type=int, nargs="+", default=[])
    ap.add_argument("--dtype", choices=["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per call")
    args = ap.parse_args()
    native.load()
    block = args.block_size
    if args.prefill:
        return prefill(args.prefill, block, KV_CACHE_DTYPES[args.dtype or "bfloat16"], args.chunk)
    blocks = CACHE_SLOTS // block
    dtype = KV_CACHE_DTYPES[args.dtype or "float16"]
    pairs = pair_layout(dtype, DIM)
    layers = 1 if args.hot else LAYERS
    caches = [torch.randn(blocks, 2, block, KV_HEADS, DIM).to(dtype) for _ in range(layers)]
    for batch, ctx in [(16, 200), (64, 200), (64, 600)]:
        order = list(range(blocks))
        random.Random(0).shuffle(order)
        width = -(-ctx // block)
        table = torch.tensor(order[: batch * width], dtype=torch.int32).view(batch, width)
        q = torch.randn(batch, HEADS, DIM)
        qsl = torch.arange(0, batch + 1, dtype=torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        times = []
        for _ in range(7):
            clock = time.perf_counter()
            for layer in range(LAYERS):
                cache = caches[layer % len(caches)]
                torch.ops.kiln_cpu.paged_attention(q, cache, qsl, lens, table, DIM**-0.5, 0, pairs)
            times.append(time.perf_counter() - clock)
        ms = statistics.median(times) * 1e3
        mb = batch * ctx * 2 * KV_HEADS * DIM * 2 * LAYERS / 1e6
        print(f"batch {batch}, context {ctx}: {ms / LAYERS:.3f} ms per layer, {mb / ms:.1f} GB/s of K/V")


def prefill(lengths: list[int], block: int, dtype: torch.dtype, chunk: int = 2048) -> None:
    pairs = pair_layout(dtype, DIM)
    for n in lengths:
        width = -(-n // block)
        order = list(range(width))
        random.Random(0).shuffle(order)
        cache = torch.randn(width, 2, block, KV_HEADS, DIM).to(dtype)
        table = torch.tensor([order], dtype=torch.int32)
        chunks = [(c, min(n, c + chunk)) for c in range(0, n, chunk)]
        qs = [torch.randn(e - c, HEADS, DIM) for c, e in chunks]
        times = []
        for _ in range(3):
            clock = time.perf_counter()
            for (c, e), q in zip(chunks, qs, strict=True):
                qsl = torch.tensor([0, e - c], dtype=torch.int32)
                lens = torch.tensor([e], dtype=torch.int32)
                torch.ops.kiln_cpu.paged_attention(q, cache, qsl, lens, table, DIM**-0.5, 0, pairs)
            times.append(time.perf_counter() - clock)
        s = statistics.median(times) * LAYERS
        flops = 4 * HEADS * DIM * (n * (n + 1) / 2) * LAYERS
        rate = flops / s / 1e9
        print(
            f"prefill {n} tokens ({dtype}, pairs {pairs}): {s:.2f} s for {LAYERS} layers, {rate:.0f} GFLOP/s"
        )


if __name__ == "__main__":
    main()
