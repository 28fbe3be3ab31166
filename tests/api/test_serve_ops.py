"""vLLM's operations flags, on one server started with all of them: the queue limits
(--max-num-queued-reqs, --max-num-queued-tokens), --enable-server-load-tracking with GET /load,
--sse-keep-alive-interval, --root-path, --enable-tokenizer-info-endpoint,
--exclude-tools-when-tool-choice-none, --log-error-stack, --uvicorn-log-level and --middleware; and
VLLM_SKIP_MODEL_NAME_VALIDATION."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.server import AUTH, Server, expect_error, post, start_server
from tests.conftest import API_KEY
from tests.models.tiny import build_default_vocab

pytestmark = pytest.mark.slow

BUSY = (
    "The engine is currently busy and cannot accept new requests. Please try again later or on a "
    "different instance."
)
BACKLOG = (
    "The engine has reached its prefill token backlog limit. Please try again later or on a different "
    "instance."
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HI = [{"role": "user", "content": "What is the weather in Paris?"}]
# A template that shows the tools it is given (the default model's shows none).
TEMPLATE = (
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.content }}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    model = build_default_vocab(tmp_path_factory.mktemp("tiny-ops"), default_model_dir)
    config = {
        "model": {"model": str(model), "max_model_len": 8192, "chat_template": TEMPLATE},
        "cache": {"kv_cache_gib": 0.05},
        "compile": {"mode": "eager"},
        # One sequence runs at a time, so a second waits in the queue, holding its prompt in the backlog.
        "scheduler": {"max_num_seqs": 1},
        "server": {"api_key": API_KEY},
    }
    flags = [
        *("--max-num-queued-reqs", "3", "--max-num-queued-tokens", "1", "--enable-server-load-tracking"),
        *("--sse-keep-alive-interval", "1", "--root-path", "/kiln", "--enable-tokenizer-info-endpoint"),
        *("--exclude-tools-when-tool-choice-none", "--log-error-stack", "--uvicorn-log-level", "warning"),
        *("--middleware", "tests.api.middleware_example.Stamp"),
    ]
    env = {"VLLM_SKIP_MODEL_NAME_VALIDATION": "true"}
    srv = start_server(tmp_path_factory.mktemp("serve-ops"), config, *flags, env=env)
    yield srv
    assert srv.stop() == 0, srv.output()


def load(server: Server) -> int:
    return httpx.get(f"{server.url}/load").json()["server_load"]


def rejections(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("kiln:admission_rejections_total{")]
    return {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in lines}


def test_queue_limits_refuse_with_503_and_keep_alive_holds_the_queued_stream(ops: Server) -> None:
    assert load(ops) == 0 and rejections(ops) == {"max_num_queued_reqs": 0.0, "max_num_queued_tokens": 0.0}
    endless = {"prompt": "count", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    client = httpx.Client(base_url=ops.url, headers=AUTH, timeout=60)
    with client.stream("POST", "/v1/completions", json=endless) as running:
        lines = running.iter_lines()
        assert next(lines).startswith("data: ")  # past its prefill: its prompt left the backlog
        queued = {"messages": HI, "max_tokens": 3, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=queued) as waiting:
            # Queued behind the running one, its stream stays open on keep-alive comments.
            chunks = waiting.iter_raw()  # (held: the iterator, once dropped, closes the stream)
            assert next(chunks) == b": keep-alive\n\n"
            assert load(ops) == 2
            # Two sequences in flight and one more fits under 3; but the queued prompt is a backlog >= 1.
            r = post(ops, "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert expect_error(r, 503, "ServiceUnavailableError") == BACKLOG
            # Two more sequences (n=2) would be 4 > 3: the sequence limit is checked first.
            r = post(ops, "/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "n": 2})
            assert expect_error(r, 503, "ServiceUnavailableError") == BUSY
            assert load(ops) == 2  # refused requests are not in flight
            running.close()  # its client leaves: it is aborted, and the queued one runs
            text = b"".join(chunks).decode()
    assert text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in text
    assert rejections(ops) == {"max_num_queued_reqs": 1.0, "max_num_queued_tokens": 1.0}
    deadline = time.monotonic() + 10
    while load(ops) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load(ops) == 0
    # With nothing queued, requests are taken again.
    assert post(ops, "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_any_model_name_is_served_without_validation(ops: Server) -> None:
    body = {"model": "gpt-4o", "prompt": "Hi", "max_tokens": 2}
    r = post(ops, "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] != "gpt-4o"  # the response names the model that answered


def test_root_path_routes_both_ways(ops: Server) -> None:
    for path in ("/kiln/v1/models", "/v1/models"):
        r = httpx.get(f"{ops.url}{path}", headers=AUTH)
        assert r.json()["data"][0]["id"].endswith("tiny-ops0")
        assert r.headers["x-stamp"] == "class"  # the operator's middleware (--middleware) ran
        assert httpx.get(f"{ops.url}{path}").status_code == 401  # the API key guards it either way


def test_tokenizer_info(ops: Server) -> None:
    info = httpx.get(f"{ops.url}/tokenizer_info").json()  # no API key: vLLM's is not guarded either
    assert next(iter(info)) == "tokenizer_class" and info["tokenizer_class"]
    assert (info["bos_token"], info["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert info["chat_template"] == TEMPLATE  # the server's (--chat-template), as vLLM gives it
    assert "vocab_file" not in info and "merges_file" not in info
    assert info["added_tokens_decoder"]["0"] == "<|endoftext|>"


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(ops: Server) -> None:
    """With --exclude-tools-when-tool-choice-none; the default server shows them (test_structured)."""
    plain = post(ops, "/v1/chat/completions", json={"messages": HI, "max_tokens": 1}).json()
    body = {"messages": HI, "max_tokens": 1, "tools": [WEATHER], "tool_choice": "none"}
    none = post(ops, "/v1/chat/completions", json=body).json()
    auto = post(ops, "/v1/chat/completions", json={**body, "tool_choice": "required"}).json()
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert auto["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


def test_error_stacks_logged_and_access_log_quiet(ops: Server) -> None:
    r = post(ops, "/v1/completions", json={"prompt": "hi", "max_tokens": -1})
    expect_error(r, 400, "BadRequestError", "max_tokens")
    out = ops.output()
    assert "POST /v1/completions: 400" in out and "Traceback" in out
    assert '"GET /load' not in out and '"POST /v1/completions' not in out  # access lines are INFO
