"""The host side of loading weights (kiln/models/staging.py): how fast a safetensors file in the page cache
is read into a ring of host buffers, by a copy out of safetensors' mmap view (what a pageable copy to a
GPU reads) and by os.preadv through a thread pool (what the stager does), per ring size and thread count.

    python perf/read_bench.py [--gib 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.models.staging import data_offsets

RINGS = [
    (16, 16, 1),
    (16, 16, 2),
    (16, 16, 4),
    (8, 8, 4),
    (8, 8, 1),
    (4, 4, 1),
    (2, 8, 1),
]  # buffers, MiB, threads


def mmap_copy(file: Path, buffers: int, chunk: int) -> None:
    ring = [torch.empty(chunk, dtype=torch.uint8) for _ in range(buffers)]
    with safe_open(file, "pt") as f:
        k = 0
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name).view(-1).view(torch.uint8)
            for start in range(0, t.numel(), chunk):
                part = t[start : start + chunk]
                ring[k % buffers][: part.numel()].copy_(part)
                k += 1


def pread(file: Path, buffers: int, chunk: int, threads: int) -> None:
    ring = [torch.zeros(chunk, dtype=torch.uint8).numpy() for _ in range(buffers)]
    size, start = file.stat().st_size, min(data_offsets(file).values())
    fd = os.open(file, os.O_RDONLY)
    with ThreadPoolExecutor(threads) as pool:
        reads = []
        for k, offset in enumerate(range(start, size, chunk)):
            if len(reads) == buffers:
                reads.pop(0).result()
            reads.append(pool.submit(os.preadv, fd, [ring[k % buffers][: min(chunk, size - offset)]], offset))
        for r in reads:
            r.result()
    os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "w.safetensors"
        save_file({f"t{i}": torch.randn(32 << 20, dtype=torch.bfloat16) for i in range(args.gib * 16)}, file)
        runs: list[tuple[str, Callable[[], None]]] = [
            ("mmap view copy_, 16 x 16 MiB ring", lambda: mmap_copy(file, 16, 16 << 20))
        ] + [
            (f"preadv, {b} x {m} MiB ring, {t} thread(s)", lambda b=b, m=m, t=t: pread(file, b, m << 20, t))
            for b, m, t in RINGS
        ]
        rates: dict[str, list[float]] = {name: [] for name, _ in runs}
        mmap_copy(file, 16, 16 << 20)  # into the page cache
        for _ in range(args.repeats):  # alternated
            for name, run in runs:
                clock = time.perf_counter()
                run()
                rates[name].append(file.stat().st_size / (time.perf_counter() - clock) / 1e9)
        for name, got in rates.items():
            print(f"{name}: " + " / ".join(f"{r:.1f}" for r in got) + " GB/s")


if __name__ == "__main__":
    main()
