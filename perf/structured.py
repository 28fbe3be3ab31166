"""What a spec's extra_body costs (structured output's json_schema, or any request field: bad_words,
allowed_token_ids): each server of the list is started in turn, its first request with the extra_body
timed (and, for kiln, the grammar compile time from /metrics), then the spec is run with its extra_body
and without, alternated for --rounds (this VM drifts 10-15%).

    .venv/bin/python perf/structured.py --servers configs/perf/servers-structured.yaml \\
        --spec configs/perf/structured-c16.yaml --rounds 3
    .venv/bin/python perf/structured.py --servers configs/perf/servers-structured.yaml \\
        --spec configs/perf/bad-words-c16.yaml --rounds 2 --out perf/results/bad-words
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import httpx
import msgspec

from kiln.perf.client import Endpoint
from kiln.perf.run import run_http, write
from kiln.perf.spec import load_spec
from kiln.perf.sweep import launch, load_servers, stop, wait_ready


def compile_seconds(base_url: str) -> float | None:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("kiln:grammar_compile_seconds_sum")]
    return sum(float(line.split()[-1]) for line in lines) if lines else None


def first_request(ep: Endpoint, extra: dict) -> dict[str, float | None]:
    """One short constrained request on a server that has not seen the schema."""
    before = compile_seconds(ep.base_url)
    body = {"model": ep.model, "prompt": "People:", "max_tokens": 8, "temperature": 0.0, **extra}
    clock = time.perf_counter()
    r = httpx.post(f"{ep.base_url}/v1/completions", json=body, headers=ep.headers(), timeout=600)
    r.raise_for_status()
    seconds = time.perf_counter() - clock
    after = compile_seconds(ep.base_url)
    compiled = None if before is None or after is None else after - before
    return {"first_request_s": round(seconds, 3), "grammar_compile_s": compiled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=Path, required=True)
    ap.add_argument("--spec", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("perf/results/structured"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    spec = load_spec(args.spec)
    plain = msgspec.structs.replace(spec, name=f"{spec.name}-plain", extra_body={})
    args.out.mkdir(parents=True, exist_ok=True)
    for server in load_servers(args.servers):
        proc = launch(server, args.out)
        try:
            wait_ready(server, proc)
            ep = Endpoint(server.base_url, server.model, server.api_key)
            rates: dict[str, list[float]] = {"plain": [], "with": []}
            first = first_request(ep, spec.extra_body)
            for i in range(args.rounds):
                for j, (kind, s) in enumerate((("plain", plain), ("with", spec))):
                    # Prompts of their own for each run, so that none reads another's prefix cache.
                    s = msgspec.structs.replace(s, seed=spec.seed + 2 * i + j)
                    result = run_http(ep, s, f"{server.name}-{kind}-r{i}")
                    write(result, args.out)
                    rates[kind].append(result.points[0].summary.output_throughput)
                    assert result.points[0].summary.failed == 0, result.points[0].summary.errors[:3]
        finally:
            stop(proc)
        plain_tps, with_tps = statistics.median(rates["plain"]), statistics.median(rates["with"])
        row = {"server": server.name, **first, "plain_tok_s": rates["plain"], "with_tok_s": rates["with"]}
        row |= {"median_plain": round(plain_tps, 1), "median_with": round(with_tps, 1)}
        row["with/plain"] = round(with_tps / plain_tps, 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
