"""SIGTERM drains: the stream in flight finishes, new requests get 503, and the process exits 0."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest

from tests.api.server import start_server
from tests.conftest import SERVE_CONFIG

pytestmark = pytest.mark.slow


def test_sigterm_drains_then_exits_zero(tmp_path: Path, default_model_dir: Path) -> None:
    config = {**SERVE_CONFIG, "server": {"drain_timeout": 60}}
    server = start_server(tmp_path, config)
    try:
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 48,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        events: list[str] = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line)
            events.append(next(lines))
            server.proc.send_signal(signal.SIGTERM)
            refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=30)
            health = httpx.get(f"{server.url}/health", timeout=30)
            events.extend(lines)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "ServiceUnavailableError"
        assert health.status_code == 503
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 48
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    assert "draining 1 requests in flight" in server.output()
