"""Compiled against eager, and the CPU lowering's choice of a dynamic token dimension over static buckets.

1. Batch-1 decode tokens/s (a 32-token prompt, 256 output tokens, greedy), eager and compiled alternating,
   `--repeats` times each; then the offline throughput workload (perf/offline_throughput.py's) once each.
2. Per decode batch size: step time of the dynamic graph kiln uses, and of a static graph compiled for
   exactly that size, with each static graph's compile time.

    python perf/compile_bench.py [--dtype auto] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import workload

from kiln import LLM, SamplingParams
from kiln.compile.buckets import Bucket
from kiln.engine.dummy_steps import DummySteps


def batch1_decode(llm: LLM) -> float:
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    prompt = list(range(100, 132))
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    return len(out.outputs[0].token_ids) / seconds


def offline(llm: LLM, vocab: int) -> float:
    work = workload(64, vocab, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def step_ms(llm: LLM, size: int, n: int = 10) -> float:
    steps = DummySteps(llm.engine.runner)
    bucket = Bucket("decode", size)
    steps.warm_step(bucket)
    start = time.perf_counter()
    for _ in range(n):
        steps.warm_step(bucket)
    return (time.perf_counter() - start) / n * 1e3


def _layer_forward(layer: torch.nn.Module, *args: object) -> object:
    return type(layer).forward(layer, *args)


def static_vs_dynamic(model: str, dtype: str, sizes: list[int]) -> list[dict]:
    dynamic = LLM(model, dtype=dtype, mode="compiled")
    rows = [{"batch": s, "dynamic_ms": step_ms(dynamic, s)} for s in sizes]
    del dynamic
    static = LLM(model, dtype=dtype, mode="eager")
    static.engine.runner.lowering.ready = False  # lets each size compile, as a static-bucket plan would
    torch._dynamo.config.recompile_limit = 64
    step = torch.compile(_layer_forward, dynamic=False, fullgraph=True)
    for layer in static.engine.model.layers:
        layer.forward = functools.partial(step, layer)
    steps = DummySteps(static.engine.runner)
    for row in rows:
        start = time.perf_counter()
        steps.warm_step(Bucket("decode", row["batch"]))  # compiles this size's graph
        row["static_compile_s"] = time.perf_counter() - start
    static.engine.runner.lowering.ready = True  # serving's guard stance, as for the dynamic graphs
    for row in rows:
        row["static_ms"] = step_ms(static, row["batch"])
        logging.info("batch %d: %s", row["batch"], row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 32, 64])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    llms = {mode: LLM(args.model, dtype=args.dtype, mode=mode) for mode in ("eager", "compiled")}
    vocab = llms["eager"].engine.model.dims.vocab_size
    b1: dict[str, list[float]] = {m: [] for m in llms}
    for _ in range(args.repeats):
        for mode, llm in llms.items():
            b1[mode].append(batch1_decode(llm))
            logging.info("batch-1 decode %s: %.1f tok/s", mode, b1[mode][-1])
    thr = {}
    for mode, llm in llms.items():
        thr[mode] = offline(llm, vocab)
        logging.info("offline throughput %s: %.1f output tok/s", mode, thr[mode])
    dtype = str(llms["eager"].engine.model.embed.weight.dtype)
    del llms
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "dtype": dtype,
        "batch1_decode_tok_s": {m: statistics.median(v) for m, v in b1.items()},
        "batch1_runs": b1,
        "offline_output_tok_s": thr,
        "static_vs_dynamic": static_vs_dynamic(args.model, args.dtype, args.sizes),
    }
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text)
    logging.info("%s", text)


if __name__ == "__main__":
    main()
