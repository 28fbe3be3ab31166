"""Serving overhead and /health latency of `kiln serve`, against the offline engine on the same requests.

    python perf/serve_bench.py [--requests 32 --concurrency 16 --prompt-len 128 --output-len 128]

1. offline: LLMEngine in this process runs the requests with max_num_seqs = concurrency;
   offline and HTTP runs alternate (`--repeats` of each, after one unmeasured run) and medians compare;
2. HTTP: `kiln serve` with the same engine config; `concurrency` clients stream the same requests
   (token-id prompts, ignore_eos) through /v1/completions; output tokens/s is compared with (1);
3. /health: with `health_streams` streams running, /health is polled back to back; p50/p99/max.
Run it on a quiet machine: on 2 cores any other process halves the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from kiln.config import EngineConfig
from kiln.engine.engine import LLMEngine
from kiln.perf.client import sse_lines
from kiln.sampling_params import SamplingParams

log = logging.getLogger("serve_bench")


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)  # distinct random prompts: no prefix-cache hits between requests
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


class Offline:
    """The engine in this process, driven directly: the baseline without HTTP."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.engine.warmup()
        self.runs = 0

    def run(self, batch: list[list[int]], output_len: int) -> dict[str, float]:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        for i, ids in enumerate(batch):
            self.engine.add_request(f"run{self.runs}-{i}", ids, params)
        self.runs += 1
        tokens = 0
        while self.engine.has_unfinished():
            tokens += sum(len(o.outputs[0].token_ids) for o in self.engine.step(final_only=True))
        wall = time.perf_counter() - start
        return {"output_tokens": tokens, "seconds": wall, "tok_per_s": tokens / wall}


def start_server(args: argparse.Namespace, port: int, max_num_seqs: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kiln", "--log-level", "WARNING", "serve", "--port", str(port)]
    cmd += ["--max-num-seqs", str(max_num_seqs), "--max-model-len", str(args.max_model_len)]
    cmd += ["--dtype", args.dtype, "--kv-cache-gib", str(args.kv_cache_gib), *args.serve_args.split()]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("kiln serve did not become ready")


async def stream_one(client: httpx.AsyncClient, ids: list[int], output_len: int) -> int:
    body = {
        "prompt": ids,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in sse_lines(r):
            if line.startswith('data: {"id"') and '"usage":{' in line:
                usage = json.loads(line[6:])["usage"]["completion_tokens"]
    return usage


async def http_run(url: str, batch: list[list[int]], output_len: int, concurrency: int) -> dict[str, float]:
    queue = list(reversed(batch))
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> int:
            done = 0
            while queue:
                done += await stream_one(client, queue.pop(), output_len)
            return done

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker() for _ in range(concurrency))))
        wall = time.perf_counter() - start
    return {"output_tokens": tokens, "seconds": wall, "tok_per_s": tokens / wall}


async def health_under_load(url: str, batch: list[list[int]], output_len: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=len(batch) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        streams = [asyncio.create_task(stream_one(client, ids, output_len)) for ids in batch]
        async with httpx.AsyncClient(base_url=url, timeout=60) as probe:
            await asyncio.sleep(1.0)  # let all streams be admitted
            latencies = []
            while not all(s.done() for s in streams):
                t = time.perf_counter()
                r = await probe.get("/health")
                latencies.append(time.perf_counter() - t)
                assert r.status_code == 200
                await asyncio.sleep(0.02)
        await asyncio.gather(*streams)
    latencies.sort()
    return {
        "probes": len(latencies),
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "max_ms": 1000 * latencies[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--health-streams", type=int, default=64, help="0: skip the /health probe")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--serve-args", default="", help="more `kiln serve` flags, e.g. '--loop-nice 0'")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    config = EngineConfig.from_options(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.concurrency,
    )
    vocab = 49152
    batch = prompts(args.requests, args.prompt_len, vocab)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    offline = Offline(config)
    server = start_server(args, port, args.concurrency)
    results: dict[str, Any] = {"offline": [], "http": []}
    try:
        # Alternating runs, after one unmeasured run of each (shape specializations compile on first use),
        # so that drift in the machine's speed hits both sides alike.
        offline.run(batch, args.output_len)
        asyncio.run(http_run(url, batch, args.output_len, args.concurrency))
        for rep in range(args.repeats):
            results["offline"].append(offline.run(batch, args.output_len))
            results["http"].append(asyncio.run(http_run(url, batch, args.output_len, args.concurrency)))
            log.info(
                "run %d: offline %.1f, http %.1f output tok/s",
                rep,
                results["offline"][-1]["tok_per_s"],
                results["http"][-1]["tok_per_s"],
            )
        del offline
        if args.health_streams:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
            server = start_server(args, port, args.health_streams)  # admits every stream at once
            load = prompts(args.health_streams, args.prompt_len, vocab, seed=1)
            results["health"] = asyncio.run(health_under_load(url, load, args.output_len))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)

    median = {k: statistics.median(r["tok_per_s"] for r in results[k]) for k in ("offline", "http")}
    results["median_tok_per_s"] = median
    results["ratio_http_to_offline"] = median["http"] / median["offline"]
    results["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}"
    results["args"] = vars(args)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
