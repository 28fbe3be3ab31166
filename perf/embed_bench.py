"""Embedding throughput through /v1/embeddings: each server of the list is started in turn; a warmup, then
`--requests` requests, `--concurrency` at a time, each with `--batch` texts of about `--words` words
(seeded: every server gets the same texts, and new ones each repeat). Reported per server: inputs and
prompt tokens a second, and the cosine between each probe text's embedding and the first server's (the
servers should agree).

    .venv/bin/python perf/embed_bench.py --servers configs/perf/servers-embed-cpu.yaml
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import random
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from kiln.perf.sweep import launch, load_servers, stop, wait_ready

WORDS = [
    "the",
    "a",
    "of",
    "river",
    "bread",
    "light",
    "keeper",
    "stone",
    "tower",
    "sea",
    "grey",
    "town",
    "lamp",
    "mill",
    "dough",
    "flour",
    "water",
    "plain",
    "city",
]


def texts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(words // 2, words * 3 // 2))) for _ in range(n)
    ]


def embed(client: httpx.Client, model: str, inputs: list[str]) -> dict:
    r = client.post("/v1/embeddings", json={"model": model, "input": inputs}, timeout=600)
    r.raise_for_status()
    return r.json()


def run(client: httpx.Client, model: str, args: argparse.Namespace, repeat: int) -> dict[str, float]:
    """New texts each repeat: a repeat of the last one's would be served from the prefix cache."""
    seeds = range(repeat * args.requests, (repeat + 1) * args.requests)
    bodies = [texts(args.batch, args.words, seed) for seed in seeds]
    clock = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        replies = list(pool.map(lambda b: embed(client, model, b), bodies))
    seconds = time.perf_counter() - clock
    tokens = sum(r["usage"]["prompt_tokens"] for r in replies)
    return {
        "seconds": round(seconds, 2),
        "inputs_per_s": round(args.requests * args.batch / seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1),
        "mean_tokens": round(tokens / (args.requests * args.batch), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--words", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("perf/results/embed_bench"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    probes = texts(8, args.words, seed=10**6)
    first: np.ndarray | None = None
    for server in load_servers(args.servers):
        proc = launch(server, args.out)
        try:
            wait_ready(server, proc)
            headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
            with httpx.Client(base_url=server.base_url, headers=headers) as client:
                got = np.array([d["embedding"] for d in embed(client, server.model, probes)["data"]])
                runs = [run(client, server.model, args, i) for i in range(args.repeats)]
        finally:
            stop(proc)
        first = got if first is None else first
        cosines = (got * first).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(first, axis=1)
        best = max(runs, key=lambda r: r["inputs_per_s"])
        report = {
            "server": server.name,
            "best": best,
            "runs": runs,
            "min_cosine_to_first": round(float(cosines.min()), 5),
        }
        report["median_inputs_per_s"] = statistics.median(r["inputs_per_s"] for r in runs)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
