"""Starts `python -m kiln serve` as a real process on a free loopback port and waits until it is ready."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

READY_TIMEOUT_S = 180
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in the child before exec: a pytest that crashes runs no teardown, and its servers would
    otherwise outlive it, holding their ports, cores and (on a GPU) the device's memory."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    statuses_before_ready: list[int] = field(default_factory=list)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def start_server(
    tmp: Path,
    config: dict,
    *flags: str,
    env: dict[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
    uds: Path | None = None,
) -> Server:
    """tls: the server speaks HTTPS, to clients that trust what this context trusts. uds: it listens on this
    Unix socket (--uds) instead of its port."""
    config_path = tmp / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp / "server.log"
    cmd = [sys.executable, "-m", "kiln", "serve", "--config", str(config_path), "--port", str(port), *flags]
    cmd += [] if uds is None else ["--uds", str(uds)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=die_with_parent,
        )
    server = Server(proc, f"{'https' if tls else 'http'}://127.0.0.1:{port}", log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {proc.returncode}:\n{server.output()}")
        try:
            transport = None if uds is None else httpx.HTTPTransport(uds=str(uds))
            with httpx.Client(transport=transport, verify=tls or True, timeout=5) as client:
                status = client.get(f"{server.url}/health").status_code
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        if status == 200:
            return server
        server.statuses_before_ready.append(status)
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"kiln serve was not ready in {READY_TIMEOUT_S} s:\n{server.output()}")


def expect_error(response: httpx.Response, status: int, kind: str, param: str | None = None) -> str:
    """Asserts an OpenAI-style error body with this status, type and param; returns its message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (kind, param, status)
    assert error["message"]
    return error["message"]


def post(server: Server, path: str, timeout: float = 60, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=AUTH, timeout=timeout, **kwargs)  # type: ignore[arg-type]
