"""Decode throughput offline, for before/after checks of the engine path: batches of 16 random 128-token
prompts, 128 greedy tokens each (ignore_eos), the default config; prints each batch's output tok/s.

    .venv/bin/python perf/batch16.py [--batches 3]

To time another checkout (a git worktree), put it first on the path:
PYTHONPATH=/tmp/kiln-before .venv/bin/python perf/batch16.py"""

from __future__ import annotations

import argparse
import json
import random
import time

from kiln import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=3)
    args = ap.parse_args()
    llm = LLM("default", max_model_len=2048)
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    rates = []
    for _ in range(args.batches):
        prompts = [{"prompt_token_ids": [rng.randrange(100, 10000) for _ in range(128)]} for _ in range(16)]
        clock = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(round(16 * 128 / (time.perf_counter() - clock), 1))
    print(json.dumps({"output tok/s": rates}))


if __name__ == "__main__":
    main()
