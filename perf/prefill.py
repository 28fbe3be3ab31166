"""Prefill speed offline: one prompt of N random token ids (or P of them at once, `--prompts P`), one
output token each, the default config (so prompts past max_num_batched_tokens are chunked, and many short
prompts share steps), prefix caching off so repeats compute everything.

    .venv/bin/python perf/prefill.py --tokens 1900 7900 [--repeats 2]
    .venv/bin/python perf/prefill.py --tokens 128 --prompts 64     # a concurrency-64 wave's prefill

To time another checkout (a git worktree of an earlier commit), put it first on the path:
PYTHONPATH=/tmp/kiln-before .venv/bin/python perf/prefill.py (a script imports kiln from PYTHONPATH before
the installed tree)."""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time

from kiln import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1900])
    ap.add_argument("--prompts", type=int, default=1, help="prompts of each length, sent together")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="model.dtype (auto, float32, bfloat16, float16)")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=None, help="default: kiln's")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(
        "default",
        dtype=args.dtype,
        enable_prefix_caching=False,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    vocab = llm.engine.model.dims.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rng = random.Random(0)
    for n in args.tokens:
        ids = [[rng.randrange(100, vocab) for _ in range(n)] for _ in range(args.prompts)]
        prompts = [{"prompt_token_ids": one} for one in ids]
        times = []
        for _ in range(args.repeats):
            clock = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - clock)
        s, total = statistics.median(times), n * args.prompts
        row = {"tokens": n, "prompts": args.prompts, "seconds": round(s, 2), "tok/s": round(total / s, 1)}
        print(json.dumps(row | {"runs": times}))


if __name__ == "__main__":
    main()
