"""`kiln perf startup`: seconds from launch to a 200 on /health, cold (the server's caches emptied first)
and warm (caches as the previous start left them), each the median of `repeats` starts."""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
from pathlib import Path

from tqdm import tqdm

from kiln.perf.sweep import ServerSpec, launch, stop, wait_ready

log = logging.getLogger(__name__)


def time_to_ready(server: ServerSpec, out_dir: Path) -> float:
    proc = launch(server, out_dir)
    try:
        return wait_ready(server, proc)
    finally:
        stop(proc)


def clear_caches(server: ServerSpec) -> None:
    for d in server.cache_dirs:
        path = Path(os.path.expanduser(os.path.expandvars(d)))
        shutil.rmtree(path, ignore_errors=True)


def startup(servers: list[ServerSpec], repeats: int, out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    steps = [(s, kind) for s in servers for kind in ("cold", "warm")]
    bar = tqdm(total=len(steps) * repeats, desc="startup", unit="start")
    for server, kind in steps:
        times = []
        for _ in range(repeats):
            if kind == "cold":
                clear_caches(server)
            times.append(time_to_ready(server, out_dir))
            log.info("%s %s start: ready in %.1f s", server.name, kind, times[-1])
            bar.update()
        rows.append(
            {"server": server.name, "start": kind, "median_s": statistics.median(times), "runs_s": times}
        )
    bar.close()
    (out_dir / "startup.json").write_text(json.dumps(rows, indent=2))
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'server':<20} {'start':<5} {'median s':>8}  runs"]
    for r in rows:
        runs = ", ".join(f"{t:.1f}" for t in r["runs_s"])
        lines.append(f"{r['server']:<20} {r['start']:<5} {r['median_s']:>8.1f}  {runs}")
    return "\n".join(lines)
