"""Per-request timings and their summary, with the definitions of vLLM's benchmark_serving:
TTFT is the first chunk's arrival, ITL the gap between consecutive chunks (one per chunk, however many
tokens it carries), TPOT (E2EL - TTFT) / (output tokens - 1) per request, E2EL the whole request.
Failed requests are counted and listed, and left out of every latency and throughput figure."""

from __future__ import annotations

import msgspec
import numpy as np

from kiln.perf.spec import SLO

PERCENTILES = (50, 90, 99)


class RequestRecord(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = msgspec.field(default_factory=list)
    latency: float = 0.0  # E2EL, seconds
    success: bool = False
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class Stats(msgspec.Struct):
    mean: float
    median: float
    p90: float
    p99: float


class Summary(msgspec.Struct, kw_only=True):
    completed: int
    failed: int
    errors: list[str]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (input + output) tokens/s
    goodput: float | None  # requests/s meeting every SLO; None without SLOs
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2el_ms: Stats

    @property
    def tokens_per_user(self) -> float:
        """Output tokens/s one user sees while decoding: 1 / mean TPOT."""
        return 1000.0 / self.tpot_ms.mean if self.tpot_ms.mean > 0 else 0.0


def stats_ms(values: list[float]) -> Stats:
    if not values:
        return Stats(0.0, 0.0, 0.0, 0.0)
    ms = np.asarray(values, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(ms, PERCENTILES)
    return Stats(float(ms.mean()), float(p50), float(p90), float(p99))


def _meets(r: RequestRecord, slo: SLO) -> bool:
    tpot = r.tpot or 0.0
    return (
        (slo.ttft_ms is None or r.ttft * 1000 <= slo.ttft_ms)
        and (slo.tpot_ms is None or tpot * 1000 <= slo.tpot_ms)
        and (slo.e2el_ms is None or r.latency * 1000 <= slo.e2el_ms)
    )


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> Summary:
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    has_slo = any(v is not None for v in (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms))
    return Summary(
        completed=len(ok),
        failed=len(failed),
        errors=[r.error for r in failed],
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        goodput=sum(_meets(r, slo) for r in ok) / duration_s if has_slo else None,
        ttft_ms=stats_ms([r.ttft for r in ok]),
        tpot_ms=stats_ms([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=stats_ms([gap for r in ok for gap in r.itl]),
        e2el_ms=stats_ms([r.latency for r in ok]),
    )
