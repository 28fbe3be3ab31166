"""kiln_cpu::linear the way a decode step meets it: the default model's four linear layers (qkv, o,
gate_up, down) for all 30 layers, each with its own 16-bit weights (212 MB, past the caches), packed as
the CPU backend packs them (bfloat16 in pairs where the kernels have AVX512-BF16), called in order at M
rows. "hot" reuses one layer's weights thirty times (they stay in cache), which is what a one-shape
benchmark measures; the gap between the two is time spent waiting on memory.

    .venv/bin/python perf/cpu_linear_layers.py [--rows 1 4 16 64] [--dtype float16|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln.ops.cpu import native
from kiln.ops.matmul import CpuMatmul

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
LAYERS = 30


def ms_per_pass(layers: list[list[torch.Tensor]], m: int, repeats: int = 15) -> float:
    xs = {k: torch.randn(m, k) for _, k in SHAPES}

    def one_pass() -> None:
        for weights in layers:
            for w, (n, k) in zip(weights, SHAPES, strict=True):
                torch.ops.kiln_cpu.linear(xs[k], w, n, None)

    for _ in range(3):
        one_pass()
    times = []
    for _ in range(repeats):
        clock = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - clock)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    args = ap.parse_args()
    native.load()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pack, dtype = CpuMatmul(bf16_dot=native.bf16_dot()).pack, getattr(torch, args.dtype)
    layers = [[pack(torch.randn(n, k).to(dtype)) for n, k in SHAPES] for _ in range(LAYERS)]
    for m in args.rows:
        cold, hot = ms_per_pass(layers, m), ms_per_pass([layers[0]] * LAYERS, m)
        gflop = 2 * m * sum(n * k for n, k in SHAPES) * LAYERS / 1e9
        print(
            f"M={m}: cold {cold:.2f} ms ({gflop / cold * 1e3:.0f} GFLOP/s), "
            f"hot {hot:.2f} ms ({gflop / hot * 1e3:.0f} GFLOP/s)"
        )


if __name__ == "__main__":
    main()
