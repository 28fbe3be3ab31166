"""/health and a small chat request's latency while 4 clients send 10 MB chat bodies in a loop.

    python perf/big_bodies.py [--seconds 30] [--json OUT]

Each server is started fresh, one after the other, on the default model at its default length (8,192):
- kiln: `kiln serve` as the README runs it; a 10 MB body is over its prompt-character limit, so it gets
  its 400 before any tokenizing;
- kiln-tokenizing: the same with `--max-prompt-chars 20000000`, so every 10 MB body is tokenized (on the
  worker thread) before its 400 for length: what the event loop and the engine feel from the work;
- vllm: vLLM 0.32 CPU, float32, threads bound to cores 0-1 (its best setting here), the same folder.
Per server: idle, the small chat (greedy, 16 tokens) is sent back to back `--idle` times while /health is
polled every 20 ms from its own process; then, for `--seconds`, 4 clients (their own process) post a 10 MB
chat body each in a loop while the small chat and the poll go on. Reported: /health p50/p99/max, the
chat's median latency idle and under load and their ratio, and the 10 MB bodies answered (by status).
Targets (issue: hostile input): /health p99 under 100 ms, the chat within 1.5x its idle latency.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import platform
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec

from kiln.perf.probe import HealthProbe
from kiln.perf.sweep import ServerSpec, launch, stop, wait_ready

log = logging.getLogger("big_bodies")

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FOLDER = "$HOME/.cache/kiln/models/SmolLM2-135M-Instruct"
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "LD_PRELOAD": "libtcmalloc_minimal.so.4",
    "HF_HUB_OFFLINE": "1",
}
SERVERS = [
    ServerSpec(name="kiln", command=".venv/bin/kiln --log-level WARNING serve --port 8100",
               base_url="http://127.0.0.1:8100", model=MODEL),
    ServerSpec(name="kiln-tokenizing",
               command=".venv/bin/kiln --log-level WARNING serve --port 8100 --max-prompt-chars 20000000",
               base_url="http://127.0.0.1:8100", model=MODEL),
    ServerSpec(name="vllm",
               command=f"/work/.venv-vllm-cpu/bin/vllm serve {FOLDER} --served-model-name {MODEL} "
               "--host 127.0.0.1 --port 8102 --dtype float32",
               env=VLLM_ENV, base_url="http://127.0.0.1:8102", model=MODEL),
]  # fmt: skip
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
    "max_tokens": 16,
    "temperature": 0,
}


def big_body() -> bytes:
    content = "word " * 2_000_000  # 10 MB
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16})


def senders(url: str, seconds: float, clients: int, out: multiprocessing.Queue) -> None:
    """Runs in its own process: `clients` threads post the 10 MB body back to back until time is up."""
    body = big_body().encode()
    deadline = time.monotonic() + seconds
    results: list[tuple[int, float]] = []

    def loop() -> None:
        with httpx.Client(base_url=url, timeout=300) as client:
            while time.monotonic() < deadline:
                start = time.perf_counter()
                try:
                    status = client.post(
                        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
                    ).status_code
                except httpx.HTTPError:
                    status = 0
                results.append((status, time.perf_counter() - start))

    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(results)


def chat_latencies(client: httpx.Client, more: Callable[[list[float]], bool]) -> list[float]:
    """The small chat, back to back, while `more(latencies so far)`."""
    out: list[float] = []
    while more(out):
        start = time.perf_counter()
        client.post("/v1/chat/completions", json=CHAT).raise_for_status()
        out.append(time.perf_counter() - start)
    return out


def health(probe: HealthProbe) -> dict[str, float]:
    return {
        "polls": len(probe.latencies),
        "p50_ms": 1000 * probe.quantile(0.5),
        "p99_ms": 1000 * probe.p99(),
        "max_ms": 1000 * max(probe.latencies),
        "non_200": sum(s != 200 for s in probe.statuses),
    }


def measure(server: ServerSpec, seconds: float, idle: int, clients: int) -> dict:
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        chat_latencies(client, lambda done: len(done) < 3)  # warm the path
        with HealthProbe(server.base_url) as probe:
            calm = chat_latencies(client, lambda done: len(done) < idle)
        idle_health = health(probe)
        queue: multiprocessing.Queue = multiprocessing.Queue()
        load = multiprocessing.Process(target=senders, args=(server.base_url, seconds, clients, queue))
        with HealthProbe(server.base_url) as probe:
            load.start()
            time.sleep(1.0)  # the first bodies are in flight
            end = time.monotonic() + seconds - 1.0
            busy = chat_latencies(client, lambda done: time.monotonic() < end)
            bodies = queue.get()
            load.join()
        load_health = health(probe)
    statuses = Counter(s for s, _ in bodies)
    return {
        "server": server.name,
        "command": server.command,
        "env": server.env,
        "idle": {"chat_s": calm, "chat_median_s": statistics.median(calm), "health": idle_health},
        "load": {
            "chat_s": busy,
            "chat_median_s": statistics.median(busy),
            "health": load_health,
            "bodies": dict(statuses),
            "body_median_s": statistics.median(t for _, t in bodies) if bodies else None,
        },
        "chat_ratio": statistics.median(busy) / statistics.median(calm),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--idle", type=int, default=10, help="small chats sent idle")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--servers", nargs="+", default=[s.name for s in SERVERS])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--kiln-src", type=Path, help="run kiln's servers from this checkout (a before run)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for server in [s for s in SERVERS if s.name in args.servers]:
            if args.kiln_src and server.name.startswith("kiln"):
                server = msgspec.structs.replace(server, env={"PYTHONPATH": str(args.kiln_src.resolve())})
            proc = launch(server, Path(logs))
            try:
                log.info("%s ready in %.1f s", server.name, wait_ready(server, proc))
                rows.append(measure(server, args.seconds, args.idle, args.clients))
            finally:
                stop(proc)
            r = rows[-1]
            log.info(
                "%s: chat idle %.3f s, under load %.3f s (x%.2f); /health p99 idle %.1f ms, under load "
                "%.1f ms (max %.1f); 10 MB bodies %s, median %.2f s",
                r["server"], r["idle"]["chat_median_s"], r["load"]["chat_median_s"], r["chat_ratio"],
                r["idle"]["health"]["p99_ms"], r["load"]["health"]["p99_ms"], r["load"]["health"]["max_ms"],
                r["load"]["bodies"], r["load"]["body_median_s"] or 0.0,
            )  # fmt: skip
    report = {
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
