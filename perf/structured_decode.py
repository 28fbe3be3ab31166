"""Offline structured decode: 16 JSON-schema requests (name, age, city) on the default model, sampled at
temperature 0.8 with seeds, 64 tokens at most; output tok/s of three runs after a warm one. Run from outside
the repository with PYTHONPATH=<tree> to time another tree (`-m`/the checkout's kiln comes first there).

    cd /tmp && PYTHONPATH=<tree> <repo>/.venv/bin/python <repo>/perf/structured_decode.py [--async-scheduling]
"""

from __future__ import annotations

import argparse
import time

import kiln
from kiln import LLM, SamplingParams
from kiln.sampling_params import StructuredOutputsParams

N = 16
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--async-scheduling", action="store_true")
    args = ap.parse_args()
    llm = LLM("default", max_model_len=512, async_scheduling=args.async_scheduling)
    so = StructuredOutputsParams(json=SCHEMA)
    ask = llm.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=64, structured_outputs=so) for s in range(N)]
    llm.generate([ask] * N, params, use_tqdm=False)
    rates = []
    for _ in range(3):
        clock = time.perf_counter()
        out = llm.generate([ask] * N, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - clock))
    scheduling = "async" if args.async_scheduling else "sync"
    print(f"{kiln.__file__} {scheduling}: " + " ".join(f"{r:.1f}" for r in rates) + " output tok/s")


if __name__ == "__main__":
    main()
