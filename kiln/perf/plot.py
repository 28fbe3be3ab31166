"""`kiln perf plot`: PNG charts of one or more results (matplotlib, without a display)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kiln.perf.run import Result


def _series(result: Result) -> dict[tuple[int, int], list]:
    """Points grouped by (input, output) lengths, in load order."""
    groups: dict[tuple[int, int], list] = {}
    for p in result.points:
        groups.setdefault((p.input_len, p.output_len), []).append(p)
    return groups


def _load(p: object) -> float:
    return p.request_rate if p.request_rate is not None else p.concurrency  # type: ignore[attr-defined]


def plot(results: list[Result], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rate_mode = all(p.request_rate is not None for r in results for p in r.points)
    xlabel = "request rate (req/s)" if rate_mode else "concurrency"
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        for (i, o), pts in _series(r).items():
            ax.plot(
                [_load(p) for p in pts],
                [p.summary.output_throughput for p in pts],
                "o-",
                label=f"{r.label} {i}/{o}",
            )
    ax.set(xlabel=xlabel, ylabel="output tokens/s", title="Throughput")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out_dir / "throughput.png"))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric, title in zip(
        axes, ("ttft_ms", "tpot_ms", "e2el_ms"), ("TTFT", "TPOT", "E2E latency"), strict=True
    ):
        for r in results:
            for (i, o), pts in _series(r).items():
                x = [_load(p) for p in pts]
                for stat, style in (("median", "o-"), ("p99", "x--")):
                    y = [getattr(getattr(p.summary, metric), stat) for p in pts]
                    ax.plot(x, y, style, label=f"{r.label} {i}/{o} {stat}")
        ax.set(xlabel=xlabel, ylabel="ms", title=title)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    paths.append(_save(fig, out_dir / "latency.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        for (i, o), pts in _series(r).items():
            xs = [p.summary.output_throughput for p in pts]
            ys = [p.summary.tokens_per_user for p in pts]
            ax.plot(xs, ys, "o-", label=f"{r.label} {i}/{o}")
            for p, x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(f"{_load(p):g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set(
        xlabel="output tokens/s (all users)",
        ylabel="output tokens/s per user (1 / TPOT)",
        title="Per-user vs total",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out_dir / "per_user.png"))
    return paths


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
