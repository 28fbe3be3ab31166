"""backend.cpu_threads_bind: the server pins its engine's OpenMP threads one per core and leaves every
other thread its CPUs; offline, only an explicit CPU list pins (the caller's thread)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from kiln.ops.cpu.threads import one_per_core, parse_cpus
from tests.api.server import Server

ALLOWED = os.sched_getaffinity(0)


def _masks(pid: int) -> list[list[int]]:
    """Each thread's allowed CPUs."""
    masks = []
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        line = next(x for x in status.read_text().splitlines() if x.startswith("Cpus_allowed_list:"))
        masks.append(parse_cpus(line.split()[1]))
    return masks


def test_parse_cpus() -> None:
    assert parse_cpus("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpus("5") == [5]


def test_server_pins_its_engine_threads_one_per_core(server: Server) -> None:
    """With one CPU, every thread's mask is that CPU, so a pinned thread cannot be told from the rest: the
    log and the masks are checked all the same."""
    logged = re.search(r"OpenMP threads pinned to CPUs \[([\d, ]+)\]", server.output())
    assert logged, "the server logs where it pinned its threads"
    cpus = [int(c) for c in logged.group(1).split(",")]
    cores = one_per_core(ALLOWED)
    assert cpus == cores[: len(cpus)] and len(cpus) >= min(2, len(cores))
    masks = _masks(server.proc.pid)
    assert all(m in [[c] for c in cpus] or set(m) == ALLOWED for m in masks)
    if len(ALLOWED) > 1:  # exactly the team's threads hold one CPU each
        assert sorted(m for m in masks if len(m) == 1) == [[c] for c in sorted(cpus)]


SCRIPT = """
import json, os, sys, torch
from kiln import LLM, SamplingParams
before = sorted(os.sched_getaffinity(0))
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
free = LLM(sys.argv[1], enforce_eager=True)
free_tokens = len(free.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids)
after_auto = sorted(os.sched_getaffinity(0))
pinned = LLM(sys.argv[1], enforce_eager=True, cpu_threads_bind=sys.argv[2])
pinned_tokens = len(pinned.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids)
print(json.dumps([before, after_auto, free_tokens, sorted(os.sched_getaffinity(0)), torch.get_num_threads(),
                  pinned_tokens]))
"""


def test_offline_pins_the_caller_only_when_given_cpus(default_model_dir: Path) -> None:
    cpu = max(ALLOWED)
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(default_model_dir), str(cpu)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    before, after_auto, free_tokens, after_list, num_threads, pinned_tokens = json.loads(
        run.stdout.splitlines()[-1]
    )
    assert before == after_auto == sorted(ALLOWED) and free_tokens == 8
    assert (after_list, num_threads, pinned_tokens) == ([cpu], 1, 8)
