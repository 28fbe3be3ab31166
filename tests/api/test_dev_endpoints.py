"""vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1) on a real server: /pause in its three modes with
/resume and /is_paused, and /reset_prefix_cache, each shown by what the requests around it do; and none
of them without the variable."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.server import AUTH, Server, expect_error, start_server
from tests.models.tiny import build_default_vocab

pytestmark = pytest.mark.slow

LONG = 600  # tokens: seconds of decoding on the tiny model, so a pause lands mid-stream


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    model = build_default_vocab(tmp_path_factory.mktemp("tiny-dev"), default_model_dir)
    config = {
        "model": {"model": str(model), "max_model_len": 1024},
        "cache": {"kv_cache_gib": 0.05},
        "compile": {"mode": "eager"},
        "server": {"enable_prompt_tokens_details": True},
    }
    srv = start_server(tmp_path_factory.mktemp("serve-dev"), config, env={"VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    assert srv.stop() == 0, srv.output()


class Stream(threading.Thread):
    """A streamed completion read on its own thread: when each chunk came, and how it ended."""

    def __init__(self, server: Server, max_tokens: int = LONG, prompt: str = "Once upon a time") -> None:
        super().__init__(daemon=True)
        self.url, self.body = f"{server.url}/v1/completions", {
            "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0,
        }  # fmt: skip
        self.times: list[float] = []
        self.finish: str | None = None
        self.tokens = 0
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                self.times.append(time.monotonic())
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    self.finish = chunk["choices"][0]["finish_reason"]
                if chunk.get("usage"):
                    self.tokens = chunk["usage"]["completion_tokens"]

    def started(self) -> None:
        while len(self.times) < 3:
            time.sleep(0.01)


def call(server: Server, method: str, path: str, **params: Any) -> httpx.Response:
    return httpx.request(method, f"{server.url}{path}", params=params, headers=AUTH, timeout=120)


def running_now(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("kiln:num_requests_running{"))
    return float(line.rsplit(" ", 1)[1])


def test_keep_freezes_and_holds_until_resume(dev: Server) -> None:
    first = Stream(dev)
    first.started()
    assert call(dev, "POST", "/pause", mode="keep").json() == {"status": "paused"}
    assert call(dev, "GET", "/is_paused").json() == {"is_paused": True}
    frozen_at = len(first.times)
    second = Stream(dev, max_tokens=8)
    time.sleep(1.0)
    assert len(first.times) <= frozen_at + 1 and not second.times  # (a chunk already sent may land)
    assert call(dev, "POST", "/resume").json() == {"status": "resumed"}
    first.join(120)
    second.join(120)
    assert (first.finish, first.tokens, second.finish, second.tokens) == ("length", LONG, "length", 8)
    assert call(dev, "GET", "/is_paused").json() == {"is_paused": False}


def test_abort_ends_what_runs_and_wait_lets_it_finish(dev: Server) -> None:
    first = Stream(dev)
    first.started()
    assert call(dev, "POST", "/pause").json() == {"status": "paused"}  # mode abort, the default
    first.join(120)
    assert first.finish == "abort" and first.tokens < LONG
    call(dev, "POST", "/resume")
    running = Stream(dev, max_tokens=200)
    running.started()
    call(dev, "POST", "/pause", mode="wait", clear_cache="false")
    assert running_now(dev) == 0  # the pause held only once the request was done
    call(dev, "POST", "/resume")
    running.join(120)
    assert (running.finish, running.tokens) == ("length", 200)


def test_reset_prefix_cache(dev: Server) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 20

    def cached() -> int:
        body = {"prompt": prompt, "max_tokens": 1}
        r = httpx.post(f"{dev.url}/v1/completions", json=body, headers=AUTH, timeout=60).json()
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    assert call(dev, "POST", "/reset_prefix_cache").json() == {"success": True}
    assert cached() == 0
    # A running request holds blocks: a reset fails, unless it preempts it (which then recomputes).
    running = Stream(dev)
    running.started()
    assert call(dev, "POST", "/reset_prefix_cache").json() == {"success": False}
    r = call(dev, "POST", "/reset_prefix_cache", reset_running_requests="true", reset_external="true")
    assert r.json() == {"success": True}
    running.join(120)
    assert (running.finish, running.tokens) == ("length", LONG)


def test_bad_parameters_and_no_dev_mode(dev: Server, server: Server) -> None:
    expect_error(call(dev, "POST", "/pause", mode="later"), 400, "BadRequestError", "mode")
    r = call(dev, "POST", "/reset_prefix_cache", reset_running_requests="maybe")
    expect_error(r, 400, "BadRequestError", "reset_running_requests")
    for method, path in (("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused")):
        assert call(server, method, path).status_code == 404
