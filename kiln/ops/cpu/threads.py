"""Keeps the engine thread's OpenMP team on its cores: pins it, one thread per CPU, as vLLM's
VLLM_CPU_OMP_THREADS_BIND does, and lowers the event loop's priority below it (yield_to_engine).

Unpinned, Linux may put both of the team's threads on one core whenever a third thread wants a core (a
grammar compiling, the event loop): every barrier then waits out a spin-wait, and an 11 ms decode step
took up to 0.7 s (BENCHMARKS.md, "A grammar compiling beside running streams"). Pinned, the third thread
shares a core and each step slows by its share at most."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import torch

from kiln.ops.cpu import native

log = logging.getLogger(__name__)


def parse_cpus(spec: str) -> list[int]:
    """ "0-3,8" -> [0, 1, 2, 3, 8], in the order given."""
    cpus: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def one_per_core(allowed: set[int]) -> list[int]:
    """The first allowed CPU of each physical core (SMT siblings share a core's vector units)."""
    cores: dict[tuple[str, str], int] = {}
    for cpu in sorted(allowed):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = ((topology / "physical_package_id").read_text(), (topology / "core_id").read_text())
        except OSError:
            core = (str(cpu), "")
        cores.setdefault(core, cpu)
    return list(cores.values())


def resolve(spec: str, own_thread: bool) -> list[int] | None:
    """The CPUs to pin the team to, one per thread, or None to leave it alone. "auto" pins only a thread
    kiln owns (the server's engine thread): pinning a caller's thread (LLM offline) would pin every thread
    and process it starts later, so that takes an explicit list. ValueError names a CPU the process may
    not use."""
    if spec == "nobind" or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    if spec == "auto":
        return one_per_core(allowed)[: torch.get_num_threads()] if own_thread else None
    cpus = parse_cpus(spec)
    if bad := sorted(set(cpus) - allowed):
        raise ValueError(f"backend.cpu_threads_bind {spec!r}: CPU {bad[0]} is not one of this process's")
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"backend.cpu_threads_bind {spec!r} names a CPU twice")
    return cpus


def bind(cpus: list[int]) -> None:
    """Pins the calling thread's team (torch.set_num_threads(len(cpus)) already): its thread i to cpus[i].
    Threads the caller starts afterwards inherit its one CPU, so start them first or give them their own
    affinity."""
    if (missing := native.available()) is not None:
        log.warning("OpenMP threads left unpinned: %s", missing)
        return
    torch.ops.kiln_cpu.bind_threads(cpus)
    log.info("OpenMP threads pinned to CPUs %s", cpus)


def yield_to_engine(nice: int) -> None:
    """Lowers this thread's priority (Linux: per thread), after the engine thread has started at the
    process's own. Receiving a 10 MB body costs the event loop ~13 ms; a client sending them back to back
    keeps it busy, and on a machine with as many cores as OpenMP threads the engine's threads then lose
    their cores to it. A decode step waits for its slowest thread, so a small chat took 4x its idle time;
    at nice 5, about 1.5x. The inputs worker, started later from this thread, inherits it."""
    if nice and sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError as e:
            log.warning("could not lower the event loop's priority: %s", e)
