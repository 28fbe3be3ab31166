"""Faults that no request can cause, injected into an in-process app serving a tiny model."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from kiln.api.app import App
from kiln.config_file import load_serve_config
from tests.models import tiny


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[App, TestClient]]:
    tiny.build("llama", tmp_path)
    config = load_serve_config(None, {"model": {"model": str(tmp_path)}, "cache": {"kv_cache_gib": 0.01}})
    app = App(config)
    with TestClient(app.starlette) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the app did not become ready"
            time.sleep(0.05)
        yield app, c


def complete(c: TestClient, **body: object) -> dict:
    return c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 8, **body}).json()


def test_unexpected_error_is_500_and_the_server_goes_on(
    client: tuple[App, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, c = client
    assert app.engine is not None
    expected = complete(c, temperature=0)
    monkeypatch.setattr(app.engine.tokenizer, "encode", lambda *a, **k: 1 / 0)
    r = c.post("/v1/completions", json={"prompt": "a b c"})
    assert r.status_code == 500
    assert r.json() == {
        "error": {
            "message": "internal server error: ZeroDivisionError: division by zero",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    monkeypatch.undo()
    assert complete(c, temperature=0)["choices"] == expected["choices"]


def test_dead_engine_fails_open_requests_and_health(
    client: tuple[App, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, c = client
    assert app.engine is not None

    def broken(*args: object) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(app.engine.engine.runner, "execute", broken)
    r = c.post("/v1/completions", json={"prompt": "a b c", "stream": True})
    events = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert '"type":"ServiceUnavailableError"' in events[-2] and "device lost" in events[-2]
    health = c.get("/health")
    assert health.status_code == 503 and "the engine has died" in health.json()["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": "a b c"})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
