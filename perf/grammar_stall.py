"""What a slow grammar compile does to a stream already running: each server of the list is started in turn;
one constrained request first builds its tokenizer view (as the first one in a server's life does), then each
round streams 300 tokens and, 20 tokens in, sends a chat request whose JSON schema (40 fields, each with a
pattern of its own, new each round) takes seconds to compile. Reported per round: the stream's inter-token
gaps while the constrained request is in flight (median, largest), and how long that request took.

    .venv/bin/python perf/grammar_stall.py --servers configs/perf/servers-grammar-stall.yaml --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import threading
import time
from pathlib import Path

import httpx

from kiln.perf.sweep import launch, load_servers, stop, wait_ready


def slow_schema(n: int) -> dict:
    """40 fields, each with a pattern no earlier round or field used (xgrammar caches a pattern's masks)."""
    # Longer bounds ([a-z]{3,120} on) trip xgrammar 0.2.8's cache (mlc-ai/xgrammar#647): rounds vary digits.
    patterns = [f"[a-z]{{3,{40 + i}}}[0-9]{{{2 + n},9}}" for i in range(40)]
    fields = {f"f{i}": {"type": "string", "pattern": p} for i, p in enumerate(patterns)}
    schema = {"type": "object", "properties": fields, "required": list(fields)}
    return {"type": "json_schema", "json_schema": {"name": f"r{n}", "schema": schema, "strict": True}}


def chat(client: httpx.Client, model: str, response_format: dict) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 5, "temperature": 0.0, "response_format": response_format}  # fmt: skip
    clock = time.monotonic()
    client.post("/v1/chat/completions", json=body, timeout=600).raise_for_status()
    return time.monotonic() - clock


def one_round(client: httpx.Client, model: str, n: int) -> dict[str, float]:
    arrivals: list[float] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0.0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with client.stream("POST", "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 20:
                        started.set()

    runner = threading.Thread(target=stream)
    runner.start()
    started.wait(600)
    sent = time.monotonic()
    seconds = chat(client, model, slow_schema(n))
    runner.join()
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if sent <= b <= sent + seconds]
    ms = sorted(round(1e3 * g, 1) for g in gaps)
    return {
        "request_s": round(seconds, 2),
        "gaps": len(ms),
        "gap_p50_ms": statistics.median(ms),
        "gap_max_ms": ms[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("perf/results/grammar_stall"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    for server in load_servers(args.servers):
        proc = launch(server, args.out)
        try:
            wait_ready(server, proc)
            headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
            with httpx.Client(base_url=server.base_url, headers=headers) as client:
                chat(client, server.model, {"type": "json_object"})
                rounds = [one_round(client, server.model, i) for i in range(args.rounds)]
        finally:
            stop(proc)
        print(json.dumps({"server": server.name, "rounds": rounds}), flush=True)


if __name__ == "__main__":
    main()
