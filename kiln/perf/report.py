"""`kiln perf compare`: every metric of two results, point by point, with their ratio."""

from __future__ import annotations

from kiln.perf.run import Point, Result, flat

_COORDS = ("label", "input_len", "output_len", "concurrency", "request_rate")


def key(point: Point) -> tuple:
    return (point.input_len, point.output_len, point.concurrency, point.request_rate)


def describe(point: Point) -> str:
    load = (
        f"concurrency {point.concurrency}" if point.request_rate is None else f"rate {point.request_rate:g}/s"
    )
    return f"input {point.input_len}, output {point.output_len}, {load}"


def compare(a: Result, b: Result) -> str:
    """A table per point the two share; ratio is b / a."""
    theirs = {key(p): p for p in b.points}
    width = max(14, len(a.label), len(b.label))
    lines = []
    for pa in a.points:
        pb = theirs.get(key(pa))
        if pb is None:
            lines.append(f"{describe(pa)}: only in {a.label}")
            continue
        lines.append(f"\n{describe(pa)}")
        lines.append(f"  {'metric':<26} {a.label:>{width}} {b.label:>{width}} {'ratio':>8}")
        row_a, row_b = flat(a, pa), flat(b, pb)
        for name, va in row_a.items():
            if name in _COORDS:
                continue
            vb = row_b[name]
            ratio = (
                f"{vb / va:8.2f}"
                if isinstance(va, int | float) and isinstance(vb, int | float) and va
                else f"{'-':>8}"
            )
            lines.append(f"  {name:<26} {_fmt(va):>{width}} {_fmt(vb):>{width}} {ratio}")
    missing = [describe(p) for p in b.points if key(p) not in {key(q) for q in a.points}]
    lines += [f"{m}: only in {b.label}" for m in missing]
    return "\n".join(lines).lstrip("\n")


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)
