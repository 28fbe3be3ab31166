"""Where a decode step's time goes on the CPU: B requests of 128 random prompt tokens decode (greedy,
ignore_eos) on the default model; after 30 steps (every prompt prefilled) it times 30 steps, then runs
10 more under the torch profiler and prints the ops by self time.

    .venv/bin/python perf/step_profile.py --batch 16 [--batch 1 64 ...] [--time-only] [--async-scheduling]

`--time-only` skips the profiler (for before/after step times: PYTHONPATH=<worktree> times another commit).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from kiln import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--rows", type=int, default=15, help="profiler table rows")
    ap.add_argument("--time-only", action="store_true", help="step times alone, no profiler")
    ap.add_argument("--dtype", default="auto", help="model.dtype (auto, float32, bfloat16, float16)")
    ap.add_argument("--async-scheduling", action="store_true", help="CUDA's default; off on the CPU")
    args = ap.parse_args()
    options = {"async_scheduling": True} if args.async_scheduling else {}
    engine = LLM("default", dtype=args.dtype, max_model_len=2048, kv_cache_gib=1, **options).engine
    for b in args.batch:
        rng = random.Random(b)
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        for i in range(b):
            engine.add_request(f"{b}-{i}", [rng.randrange(100, 10_000) for _ in range(128)], params)
        for _ in range(30):
            engine.step()
        times = []
        for _ in range(30):
            clock = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - clock)
        step = statistics.median(times)
        print(f"batch {b}: step median {step * 1e3:.2f} ms, {b / step:.1f} tok/s")
        if args.time_only:
            while engine.has_unfinished():
                engine.step()
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        while engine.has_unfinished():
            engine.step()


if __name__ == "__main__":
    main()
