"""The penalties' bookkeeping alone (TokenCounts): one step's rows gathered, then its sampled tokens counted,
for B sequences of which every other one (or, with --all, every one) uses a penalty, on the default model's
vocabulary.

    cd /tmp && PYTHONPATH=<tree> python <tree>/perf/penalty_rows.py [--batch 64] [--steps 200] [--all]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln.engine.request import Request
from kiln.engine.token_counts import TokenCounts
from kiln.platform import keep_freed_memory
from kiln.sampling_params import SamplingParams

VOCAB = 49_152


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--all", action="store_true", help="every row penalised")
    args = ap.parse_args()
    keep_freed_memory()  # as the runner does on a CPU
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams()]
    reqs = [
        Request(f"r{i}", f"r{i}", p, list(range(i, i + 500)), 500, 4096, text=None)  # type: ignore[arg-type]
        for i, p in enumerate(params[0 if args.all else i % 2] for i in range(args.batch))
    ]
    counts = TokenCounts(VOCAB, torch.device("cpu"))
    times = []
    for _ in range(args.steps):
        clock = time.perf_counter()
        counts.penalties(reqs)
        counts.update(torch.randint(0, VOCAB, (args.batch,)))
        times.append(time.perf_counter() - clock)
    median = statistics.median(times[args.steps // 10 :]) * 1e3
    which = "every row" if args.all else "every other row"
    print(f"batch {args.batch}, {which} penalised: {median:.3f} ms a step (median)")


if __name__ == "__main__":
    main()
