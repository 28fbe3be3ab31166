"""What a probe of bad and extreme input found, each fixed and held here through a real server: token ids
out of range, JSON nested 10,000 deep, 10 MB bodies, and requests that asked for unbounded work."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kiln.perf.probe import HealthProbe
from tests.api.server import AUTH, Server, expect_error, post
from tests.conftest import TINY_LIMITS, TINY_MAX_MODEL_LEN

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Hi"}]


def completion(server: Server, **body: object) -> dict:
    r = post(server, "/v1/completions", json={"max_tokens": 4, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("prompt", [[1, 2, -1], [[1, 2], [3, -1]], [1, 2, 2**70], [1, 2, 10**9], [2**64]])
@pytest.mark.parametrize("echo", [False, True])
def test_token_ids_out_of_range(tiny_server: Server, prompt: list, echo: bool) -> None:
    r = post(tiny_server, "/v1/completions", json={"prompt": prompt, "echo": echo})
    assert "must be in [0, 49152)" in expect_error(r, 400, "BadRequestError", "prompt")
    r = post(tiny_server, "/detokenize", json={"tokens": [1, -1]})
    expect_error(r, 400, "BadRequestError", "tokens")
    r = post(tiny_server, "/v1/completions", json={"prompt": "x", "stop_token_ids": [10**9]})
    expect_error(r, 400, "BadRequestError", "stop_token_ids")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_deep_json(tiny_server: Server, path: str) -> None:
    deep = b"[" * 10_000 + b"]" * 10_000
    skipped = b'{"prompt": "x", "messages": [], "extra": ' + deep + b"}"  # an unknown field's value
    untyped = b'{"structured_outputs": {"json": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_002
    r = post(tiny_server, path, content=untyped)
    assert "nested too deeply" in expect_error(r, 400, "BadRequestError")
    r = post(tiny_server, path, content=skipped)
    if path == "/tokenize":  # vLLM's extension: unknown fields are skipped, however deep
        assert "nested too deeply" in expect_error(r, 400, "BadRequestError")
    else:  # OpenAI's endpoints: the first field they do not implement is the 400, before its value
        unknown = "messages" if path == "/v1/completions" else "prompt"
        assert "unsupported field" in expect_error(r, 400, "BadRequestError", unknown)
    param = "messages" if path == "/v1/chat/completions" else "prompt"
    typed = b'{"%s": ' % param.encode() + deep + b"}"  # the schema refuses it a few levels down
    expect_error(post(tiny_server, path, content=typed), 400, "BadRequestError", param)


def test_large_body_never_stalls_the_server(tiny_server: Server) -> None:
    """A 10 MB chat body is tokenized (~6 s) on the worker while /health and a small chat answer at once.
    Over the server's max_prompt_chars, the same body gets its 400 before any tokenizing."""
    big = {"messages": [{"role": "user", "content": "word " * 2_000_000}], "max_tokens": 1}
    answer: dict[str, object] = {}

    def send() -> None:
        start = time.perf_counter()
        answer["response"] = post(tiny_server, "/v1/chat/completions", json=big, timeout=120)
        answer["seconds"] = time.perf_counter() - start

    chats = []
    with HealthProbe(tiny_server.url) as probe:
        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.5)  # the body is sent and being tokenized
        while sender.is_alive():
            start = time.perf_counter()
            r = post(tiny_server, "/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
            assert r.status_code == 200, r.text
            chats.append(time.perf_counter() - start)
            time.sleep(0.1)
        sender.join()
    message = expect_error(answer["response"], 400, "BadRequestError", "max_tokens")  # type: ignore[arg-type]
    assert f"maximum context length is {TINY_MAX_MODEL_LEN}" in message
    print(f"10 MB chat body: 400 after {answer['seconds']:.1f} s; small chats {chats}; {probe.summary()}")
    assert answer["seconds"] > 1.0  # it was really tokenized, so the test shows what it claims
    assert len(chats) >= 3 and max(chats) < 1.0, chats
    assert set(probe.statuses) == {200}
    assert probe.p99() < 0.1, probe.summary()

    over = {"messages": [{"role": "user", "content": "a" * (TINY_LIMITS["max_prompt_chars"] + 1)}]}
    start = time.perf_counter()
    r = post(tiny_server, "/v1/chat/completions", json=over)
    assert "server.max_prompt_chars" in expect_error(r, 400, "BadRequestError", "messages")
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "path, body, param, limit",
    [
        ("/v1/chat/completions", {"messages": HI, "n": 5}, "n", "server.max_n_sequences"),
        ("/v1/completions", {"prompt": "x", "n": 1000}, "n", "server.max_n_sequences"),
        ("/v1/completions", {"prompt": "x", "stop": list("abcde")}, "stop", "server.max_stop_strings"),
        ("/v1/completions", {"prompt": ["x"] * 5}, "prompt", "server.max_completion_prompts"),
    ],
)
def test_limits(tiny_server: Server, path: str, body: dict, param: str, limit: str) -> None:
    assert limit in expect_error(post(tiny_server, path, json=body), 400, "BadRequestError", param)


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"chat_template_kwargs": {"chat_template": "{% for i in range(99999) %}{% endfor %}"}},
            "chat_template_kwargs",
        ),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        ({"seed": 2**70}, "seed"),
    ],
)
def test_template_kwargs_and_seed(tiny_server: Server, body: dict, param: str) -> None:
    """A request's own chat template could loop for hours on the event loop; a seed past 64 bits got a
    400 that named nothing."""
    r = post(tiny_server, "/v1/chat/completions", json={"messages": HI, **body})
    expect_error(r, 400, "BadRequestError", param)


@pytest.mark.parametrize(
    "messages, where",
    [
        ([{"role": "wizard", "content": "hi"}], "$.messages[0].role"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]"),
        ([HI[0], {"role": "user", "content": [{"type": "image_url"}]}], "messages[1].content[0]"),
        ([{"content": "hi"}], "$.messages[0]"),
    ],
)
def test_roles_and_parts(tiny_server: Server, messages: list, where: str) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        r = post(tiny_server, path, json={"messages": messages})
        assert where in expect_error(r, 400, "BadRequestError", "messages")


def test_echo_with_no_tokens_returns_the_prompt(tiny_server: Server) -> None:
    """As vLLM: the prompt alone, with the prompt's logprobs equal to those that echo with one token gives."""
    alone = completion(tiny_server, prompt="The sea is", echo=True, max_tokens=0, logprobs=2)
    one = completion(tiny_server, prompt="The sea is", echo=True, max_tokens=1, logprobs=2)
    choice = alone["choices"][0]
    assert choice["text"] == "The sea is" and choice["finish_reason"] == "length"
    assert alone["usage"]["completion_tokens"] == 0
    n = len(choice["logprobs"]["tokens"])
    assert n == alone["usage"]["prompt_tokens"] and choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"] == one["choices"][0]["logprobs"]["token_logprobs"][:n]
    assert completion(tiny_server, prompt=[1, 2, 3], echo=True, max_tokens=0)["choices"][0]["text"]

    events = []
    stream = {"prompt": "The sea is", "echo": True, "max_tokens": 0, "logprobs": 2, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=stream, headers=AUTH) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == "The sea is"
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"]
    r = post(tiny_server, "/v1/completions", json={"prompt": "x", "max_tokens": 0})
    expect_error(r, 400, "BadRequestError", "max_tokens")  # without echo, as vLLM
