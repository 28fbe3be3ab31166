"""kiln's CPU kernels against torch on the default model's shapes (SmolLM2-135M): each linear layer and the
LM head at batch sizes 1 to 512, paged attention for decode and prefill, and the structured-output mask
against xgrammar's CPU kernel (random bitmasks over the 49,152-token vocabulary).

    .venv/bin/python perf/cpu_kernels.py [--threads 2] [--parts linear attention mask]
        [--dtype float16|bfloat16] [--rows 1 4 16 64 512] [--out perf/results/cpu_kernels.json]

Linear, per shape and rows M, in ms per call (median of repeated runs for ~0.3 s each):
- torch-16: with `--dtype float16`, what kiln ran before its CPU kernels: torch's 16-bit GEMV for one row,
  else the 16-bit weight upcast per call and torch's float32 GEMM; with `--dtype bfloat16`, torch's own
  bfloat16 GEMM (oneDNN, AMX where the CPU has it) on x rounded to bfloat16;
- torch-32: torch's float32 GEMM on a float32 copy made once (twice the weights' memory);
- kiln: kiln_cpu::linear on the 16-bit weights, packed as the CPU backend packs them."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.ops.cpu import native
from kiln.ops.matmul import CpuMatmul

# (name, out, in): qkv, o, gate_up, down, and the tied LM head.
SHAPES = [
    ("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("head", 49152, 576),
]  # fmt: skip


def ms(fn: Callable[[], object], budget: float = 0.3) -> float:
    for _ in range(3):
        fn()
    times = []
    end = time.perf_counter() + budget
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def linear_rows(dtype: torch.dtype, rows: list[int]) -> list[dict]:
    out = []
    pack = CpuMatmul(bf16_dot=native.bf16_dot()).pack
    for name, n, k in SHAPES:
        w = torch.randn(n, k).to(dtype)
        w32, packed = w.float(), pack(w)
        for m in rows:
            if name == "head" and m > 64:
                continue
            x = torch.randn(m, k)
            if dtype == torch.bfloat16 or m == 1:
                before = ms(functools.partial(lambda x, w: F.linear(x.to(w.dtype), w).float(), x, w))
            else:
                before = ms(functools.partial(lambda x, w: F.linear(x, w.float()), x, w))
            row = {
                "shape": name, "n": n, "k": k, "m": m, "torch-16": before,
                "torch-32": ms(functools.partial(F.linear, x, w32)),
                "kiln": ms(functools.partial(torch.ops.kiln_cpu.linear, x, packed, n, None)),
            }  # fmt: skip
            row["kiln GFLOP/s"] = 2 * m * n * k / row["kiln"] / 1e6
            out.append(row)
            print(
                f"{name:8} M={m:<4} torch-16 {row['torch-16']:8.3f}  torch-32 {row['torch-32']:8.3f}  "
                f"kiln {row['kiln']:8.3f} ms  ({row['kiln GFLOP/s']:.0f} GFLOP/s)"
            )
    return out


def attention_rows() -> list[dict]:
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    out = []
    cases = [("decode", 1, 512), ("decode", 16, 512), ("decode", 1, 4096), ("prefill", 1, 2048)]
    for kind, batch, ctx in cases:
        blocks = batch * ctx // bs
        cache = torch.randn(blocks + 1, 2, bs, kv_heads, dim).half()
        table = torch.arange(blocks, dtype=torch.int32).view(batch, ctx // bs)
        rows = 1 if kind == "decode" else ctx
        q = torch.randn(batch * rows, heads, dim)
        qsl = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        op = torch.ops.kiln_cpu.paged_attention
        attend = functools.partial(op, q, cache, qsl, lens, table, dim**-0.5, 0, False)
        t = ms(attend, 1.0)
        out.append({"kind": kind, "batch": batch, "context": ctx, "ms per layer": t})
        print(f"attention {kind:7} batch {batch:<3} context {ctx:<5} {t:8.3f} ms per layer")
    return out


def mask_rows() -> list[dict]:
    import xgrammar as xgr

    from kiln.ops.cpu.sampling import apply_bitmask

    vocab, out = 49152, []
    for batch in (1, 16, 64):
        logits = torch.randn(batch, vocab)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, vocab // 32), dtype=torch.int32)
        rows = list(range(batch))
        theirs = ms(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows))  # noqa: B023
        ours = ms(lambda: apply_bitmask(logits, bitmask, rows))  # noqa: B023
        out.append({"rows": batch, "xgrammar ms": theirs, "kiln ms": ours})
        print(f"mask rows {batch:<3} xgrammar {theirs:8.3f} ms  kiln {ours:8.3f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16", help="linear weights")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512], help="linear rows M")
    parts = ["linear", "attention", "mask"]
    ap.add_argument("--parts", nargs="+", choices=parts, default=parts)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native.load()
    result: dict[str, object] = {"threads": args.threads, "dtype": args.dtype}
    if "linear" in args.parts:
        result["linear"] = linear_rows(getattr(torch, args.dtype), args.rows)
    if "attention" in args.parts:
        result["attention"] = attention_rows()
    if "mask" in args.parts:
        result["mask"] = mask_rows()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
