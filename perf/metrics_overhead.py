"""The Prometheus metrics' cost per engine step on the event loop: 16 requests, 200 steps of one token
each (observe per output, then the step's histogram), median of 7 runs, in microseconds per step. The
RequestOutputs are built inside the loop, as the engine builds them.

    .venv/bin/python perf/metrics_overhead.py
"""

from __future__ import annotations

import statistics
import time

from kiln.engine.metrics import Metrics
from kiln.engine.request_output import CompletionOutput, RequestOutput
from kiln.engine.request_stream import RequestStream
from kiln.sampling_params import SamplingParams

ROWS, STEPS = 16, 200


def run() -> float:
    metrics = Metrics("m", lambda: {}, 2048)
    params = SamplingParams(max_tokens=STEPS)
    streams = [RequestStream(str(i), lambda _: None, params) for i in range(ROWS)]
    prompt = list(range(100))
    clock = time.perf_counter()
    for step in range(STEPS):
        now, tokens, last = time.monotonic(), 0, step == STEPS - 1
        for i, stream in enumerate(streams):
            seq = CompletionOutput(0, "x", [5], None, None, "length" if last else None, None)
            tokens += metrics.observe(
                stream, RequestOutput(str(i), None, prompt, None, [seq], last, 0, now), now
            )
        metrics.step(tokens)
    return (time.perf_counter() - clock) / STEPS * 1e6


if __name__ == "__main__":
    print(f"{statistics.median(run() for _ in range(7)):.1f} us per {ROWS}-row step")
