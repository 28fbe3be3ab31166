"""Structured output's cost: each server of the list is started in turn, its first constrained request
timed (and, for kiln, the grammar compile time from /metrics), then the spec is run with its extra_body (a
json_schema on every request) and without, alternated for --rounds (this VM drifts 10-15%).

    .venv/bin/python perf/structured.py --servers configs/perf/servers-structured.yaml \\
        --spec configs/perf/structured-c16.yaml --rounds 3
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
    free = msgspec.structs.replace(spec, name=f"{spec.name}-free", extra_body={})
    args.out.mkdir(parents=True, exist_ok=True)
    for server in load_servers(args.servers):
        proc = launch(server, args.out)
        try:
            wait_ready(server, proc)
            ep = Endpoint(server.base_url, server.model, server.api_key)
            rates: dict[str, list[float]] = {"free": [], "json": []}
            first = first_request(ep, spec.extra_body)
            for i in range(args.rounds):
                for j, (kind, s) in enumerate((("free", free), ("json", spec))):
                    # Prompts of their own for each run, so that none reads another's prefix cache.
                    s = msgspec.structs.replace(s, seed=spec.seed + 2 * i + j)
                    result = run_http(ep, s, f"{server.name}-{kind}-r{i}")
                    write(result, args.out)
                    rates[kind].append(result.points[0].summary.output_throughput)
                    assert result.points[0].summary.failed == 0, result.points[0].summary.errors[:3]
        finally:
            stop(proc)
        free_tps, json_tps = statistics.median(rates["free"]), statistics.median(rates["json"])
        row = {"server": server.name, **first, "free_tok_s": rates["free"], "json_tok_s": rates["json"]}
        row |= {"median_free": round(free_tps, 1), "median_json": round(json_tps, 1)}
        row["json/free"] = round(json_tps / free_tps, 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
