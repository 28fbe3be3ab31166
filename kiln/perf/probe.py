"""Polls /health every 20 ms from its own process while a test or benchmark runs, so the caller's own work
(a fuzzer generating bodies, a client sending 10 MB) never shows in the timings.

    with HealthProbe(url) as probe:
        ...
    probe.latencies  # seconds, one per poll; every poll must have answered 200"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx


class HealthProbe:
    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.statuses: list[int] = []

    def __enter__(self) -> HealthProbe:
        cmd = [sys.executable, "-m", "kiln.perf.probe", self.url]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the /health probe could not reach {self.url}")
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self.proc.communicate("", timeout=60)
        polls = json.loads(out)
        self.latencies = [p[0] for p in polls]
        self.statuses = [p[1] for p in polls]

    def quantile(self, q: float) -> float:
        lat = sorted(self.latencies)
        return lat[round(q * (len(lat) - 1))]

    def p99(self) -> float:
        return self.quantile(0.99)

    def summary(self) -> str:
        return (
            f"/health: {len(self.latencies)} polls, p50 {1000 * self.quantile(0.5):.1f} ms, "
            f"p99 {1000 * self.p99():.1f} ms, max {1000 * max(self.latencies):.1f} ms"
        )


def main(url: str) -> None:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    polls = []
    with httpx.Client(base_url=url, timeout=30) as client:
        client.get("/health")  # connect before timing
        print("ready", flush=True)
        while not stop.is_set():
            start = time.perf_counter()
            status = client.get("/health").status_code
            polls.append((time.perf_counter() - start, status))
            stop.wait(0.02)
    print(json.dumps(polls), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
