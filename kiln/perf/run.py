"""Runs a spec's sweep against an endpoint and writes the result as JSON and CSV."""

from __future__ import annotations

import asyncio
import csv
import datetime
import logging
import os
import platform
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec

from kiln.perf.client import Endpoint, run_load
from kiln.perf.dataset import Prompt, make_prompts
from kiln.perf.metrics import RequestRecord, Summary, summarize
from kiln.perf.spec import Spec

log = logging.getLogger(__name__)

# A point's load generator: (prompts, load, rng, label) -> (records, wall seconds).
Driver = Callable[[list[Prompt], tuple[str, float], random.Random, str], tuple[list[RequestRecord], float]]


class Point(msgspec.Struct, kw_only=True):
    input_len: int
    output_len: int
    concurrency: int | None
    request_rate: float | None
    summary: Summary


class Result(msgspec.Struct, kw_only=True):
    label: str
    spec: Spec
    target: dict[str, Any]  # base URL, model and the server's /version, or the offline engine config
    client: dict[str, Any]
    date: str
    points: list[Point]


def machine() -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def sweep(
    spec: Spec, drive: Driver, label: str, target: dict[str, Any], vocab_size: int | None = None
) -> Result:
    points = []
    for input_len, output_len in spec.lengths:
        for kind, value in spec.loads():
            rng = random.Random(f"{spec.seed}/{input_len}/{output_len}/{kind}/{value}")
            if spec.warmup_requests:
                warm = make_prompts(spec, input_len, output_len, spec.warmup_requests, rng, vocab_size)
                drive(warm, ("concurrency", float(len(warm))), rng, "warmup")
            n = max(spec.num_prompts, int(value)) if kind == "concurrency" else spec.num_prompts
            prompts = make_prompts(spec, input_len, output_len, n, rng, vocab_size)
            name = f"{label} in={input_len} out={output_len} {kind}={value:g}"
            records, duration = drive(prompts, (kind, value), rng, name)
            summary = summarize(records, duration, spec.slo)
            log.info(
                "%s: %d ok, %d failed, %.1f output tok/s, TTFT p50 %.0f ms, TPOT p50 %.1f ms",
                name,
                summary.completed,
                summary.failed,
                summary.output_throughput,
                summary.ttft_ms.median,
                summary.tpot_ms.median,
            )
            for error in sorted(set(summary.errors))[:5]:
                log.warning("%s: failed request: %s", name, error)
            points.append(
                Point(
                    input_len=input_len,
                    output_len=output_len,
                    concurrency=int(value) if kind == "concurrency" else spec.max_concurrency,
                    request_rate=value if kind == "request_rate" else None,
                    summary=summary,
                )
            )
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return Result(label=label, spec=spec, target=target, client=machine(), date=date, points=points)


def run_http(ep: Endpoint, spec: Spec, label: str) -> Result:
    try:
        version = httpx.get(f"{ep.base_url}/version", headers=ep.headers(), timeout=30).json()
    except (httpx.HTTPError, ValueError) as e:
        version = {"error": str(e)}

    def drive(
        prompts: list[Prompt], load: tuple[str, float], rng: random.Random, name: str
    ) -> tuple[list[RequestRecord], float]:
        return asyncio.run(run_load(ep, prompts, spec, load, rng, name))

    target = {"base_url": ep.base_url, "model": ep.model, "version": version}
    return sweep(spec, drive, label, target)


SCALARS = (
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "goodput",
    "tokens_per_user",
)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
STATS = ("mean", "median", "p90", "p99")


def flat(result: Result, point: Point) -> dict[str, Any]:
    """One CSV row: the point's coordinates, then every metric."""
    s = point.summary
    row: dict[str, Any] = {
        "label": result.label,
        "input_len": point.input_len,
        "output_len": point.output_len,
        "concurrency": point.concurrency,
        "request_rate": point.request_rate,
    }
    row.update({name: getattr(s, name) for name in SCALARS})
    for metric in LATENCIES:
        row.update({f"{metric}_{stat}": getattr(getattr(s, metric), stat) for stat in STATS})
    return row


def write(result: Result, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{result.label}-{result.spec.name}"
    json_path, csv_path = stem.with_suffix(".json"), stem.with_suffix(".csv")
    json_path.write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    with csv_path.open("w", newline="") as f:
        rows = [flat(result, point) for point in result.points]
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["label"])
        writer.writeheader()
        writer.writerows(rows)
    return json_path, csv_path


def read(path: Path) -> Result:
    return msgspec.json.decode(path.read_bytes(), type=Result)
