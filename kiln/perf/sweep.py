"""`kiln perf serve-sweep`: start each server in turn, wait for /health, run the spec, stop it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import msgspec
import yaml

from kiln.config_file import ConfigError, validation_message
from kiln.perf.client import Endpoint
from kiln.perf.report import compare
from kiln.perf.run import Result, run_http, write
from kiln.perf.spec import Spec

log = logging.getLogger(__name__)


class ServerSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    command: str  # run by bash, in its own process group, so that stopping it stops its children
    base_url: str
    model: str
    env: dict[str, str] = {}
    api_key: str | None = None
    ready_timeout_s: float = 600.0
    log: str | None = None  # where its output goes; default: OUT/NAME.log
    cache_dirs: list[str] = []  # what `kiln perf startup` empties before a cold start ($VARS and ~ expand)


class Servers(msgspec.Struct, forbid_unknown_fields=True):
    servers: list[ServerSpec]


def load_servers(path: Path) -> list[ServerSpec]:
    try:
        return msgspec.convert(yaml.safe_load(path.read_text()), Servers).servers
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {validation_message(e)}") from None


def wait_ready(server: ServerSpec, proc: subprocess.Popen) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < server.ready_timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server {server.name!r} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
                return time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server {server.name!r} was not ready in {server.ready_timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def launch(server: ServerSpec, out_dir: Path) -> subprocess.Popen:
    """Starts the server's command in its own process group, its output in its log file."""
    log_path = Path(server.log) if server.log else out_dir / f"{server.name}.log"
    log.info("starting %s: %s (output in %s)", server.name, server.command, log_path)
    with log_path.open("wb") as out:
        return subprocess.Popen(
            ["bash", "-c", server.command],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **server.env},
            start_new_session=True,
        )


def memory_mib(session: int) -> dict[str, float]:
    """The server's memory now, over every process of its session (vLLM runs several): proportional set
    size (shared pages split among the processes that map them) and the sum of each process's peak RSS
    (an upper bound of the peak). Linux only; empty elsewhere."""
    pss = peak = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) != session:
                continue
            rollup = (stat.parent / "smaps_rollup").read_text()
            status = (stat.parent / "status").read_text()
        except (OSError, IndexError, ValueError):
            continue  # exited, or not ours to read
        pss += sum(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
        peak += sum(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    return {"pss_mib": pss / 1024, "peak_rss_sum_mib": peak / 1024} if pss else {}


def serve_sweep(servers: list[ServerSpec], spec: Spec, out_dir: Path) -> list[Result]:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for server in servers:
        proc = launch(server, out_dir)
        try:
            ready = wait_ready(server, proc)
            log.info("%s ready in %.1f s", server.name, ready)
            ep = Endpoint(server.base_url, server.model, server.api_key)
            result = run_http(ep, spec, server.name)
            result.target["command"] = server.command
            result.target["env"] = server.env
            result.target["ready_s"] = ready
            result.target["memory"] = memory_mib(proc.pid)
            log.info("%s: memory after the sweep %s", server.name, result.target["memory"])
        finally:
            stop(proc)
        json_path, _ = write(result, out_dir)
        log.info("%s: wrote %s", server.name, json_path)
        results.append(result)
    if len(results) > 1:
        text = "\n\n".join(
            f"# {results[0].label} vs {r.label}\n{compare(results[0], r)}" for r in results[1:]
        )
        (out_dir / f"comparison-{spec.name}.txt").write_text(text + "\n")
    return results
