"""Fairness offline: a short prompt that arrives while a long one is being prefilled. The long prompt
(random token ids, one output token; `--long-prompts N` of them, together) starts; `--after` seconds
later a 4-token prompt is added; prints when each got its first token. The threshold is vLLM's knob,
passed as an engine option (default: kiln's, 128 on the CPU, 1024 on AMX tiles; 0: no limit).

    .venv/bin/python perf/fairness.py --tokens 7900 [--after 2] [--long-prefill-token-threshold 0] \
        [--long-prompts 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time

from kiln import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=7900)
    ap.add_argument("--after", type=float, default=2.0)
    ap.add_argument("--long-prefill-token-threshold", type=int, default=None)
    ap.add_argument("--long-prompts", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(
        "default",
        enable_prefix_caching=False,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model.dims.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1)
    first: dict[str, float] = {}
    clock = time.perf_counter()
    longs = [f"long{i}" if i else "long" for i in range(args.long_prompts)]
    for rid in longs:
        engine.add_request(rid, [rng.randrange(100, vocab) for _ in range(args.tokens)], params)
    short_at = None
    while engine.has_unfinished():
        if short_at is None and time.perf_counter() - clock >= args.after:
            short_at = time.perf_counter() - clock
            engine.add_request("short", "Hi", SamplingParams(temperature=0.0, max_tokens=1))
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - clock)
    print(
        json.dumps(
            {
                "tokens": args.tokens,
                "chunk": engine.scheduler.chunk,
                "long prefill s": [round(first[rid], 2) for rid in longs]
                if len(longs) > 1
                else round(first["long"], 2),
                "short arrived s": round(short_at, 2) if short_at is not None else None,
                "short waited s": round(first["short"] - short_at, 2) if short_at is not None else None,
            }
        )
    )


if __name__ == "__main__":
    main()
