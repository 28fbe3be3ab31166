"""vLLM's serve flags that set server-wide behaviour, on one server started with all of them: HTTPS
(--ssl-*), --tokenizer, --no-enable-prefix-caching, --response-role, --return-tokens-as-token-ids,
--enable-force-include-usage, --default-chat-template-kwargs with --trust-request-chat-template,
--disable-uvicorn-access-log, --trust-remote-code and --middleware (a function); and a request's own chat
template refused where the server does not trust it."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.server import AUTH, Server, expect_error, post, start_server
from tests.conftest import API_KEY
from tests.models.tiny import build_default_vocab

pytestmark = pytest.mark.slow

TLS = Path(__file__).parent / "tls"  # a self-signed certificate for 127.0.0.1, valid for a century
TEMPLATE = "{{ greeting }}{% for m in messages %} {{ m.content }}{% endfor %}"
HI = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def trust() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(TLS / "cert.pem"))


@pytest.fixture(scope="module")
def flagged(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path, trust: ssl.SSLContext
) -> Iterator[Server]:
    # The folder's tokenizer has a token the default one lacks: --tokenizer makes it several tokens.
    model = build_default_vocab(tmp_path_factory.mktemp("tiny-flags"), default_model_dir, added=("<odd>",))
    config = {
        "model": {"model": str(model), "max_model_len": 256},
        "cache": {"kv_cache_gib": 0.02},
        "compile": {"mode": "eager"},
        "server": {"api_key": API_KEY, "enable_prompt_tokens_details": True},
    }
    flags = [
        *("--ssl-certfile", str(TLS / "cert.pem"), "--ssl-keyfile", str(TLS / "key.pem")),
        *("--tokenizer", str(default_model_dir), "--no-enable-prefix-caching", "--response-role", "bot"),
        *("--return-tokens-as-token-ids", "--enable-force-include-usage", "--trust-request-chat-template"),
        *("--default-chat-template-kwargs", json.dumps({"greeting": "Ahoy"}), "--disable-uvicorn-access-log"),
        *("--trust-remote-code", "--middleware", "tests.api.middleware_example.stamp"),
        *("--kv-cache-dtype", "fp8", "--enable-per-request-metrics"),
    ]
    srv = start_server(tmp_path_factory.mktemp("serve-flags"), config, *flags, tls=trust)
    yield srv
    assert srv.stop() == 0, srv.output()


def call(server: Server, trust: ssl.SSLContext, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, verify=trust, timeout=60)


def test_https_only(flagged: Server, trust: ssl.SSLContext) -> None:
    assert flagged.url.startswith("https://")
    r = httpx.get(f"{flagged.url}/v1/models", headers=AUTH, verify=trust)
    assert r.status_code == 200 and r.headers["x-stamp"] == "function"  # --middleware's async function
    with pytest.raises(httpx.TransportError):  # a client that does not trust the certificate
        httpx.get(f"{flagged.url}/v1/models", headers=AUTH, verify=True)
    assert "kiln is ready at https://127.0.0.1" in flagged.output()


def test_the_tokenizer_is_the_flags_and_nothing_is_cached(flagged: Server, trust: ssl.SSLContext) -> None:
    r = call(flagged, trust, "/tokenize", {"prompt": "<odd>", "add_special_tokens": False})
    assert r.json()["count"] > 1
    prompt = "a prompt long enough to fill one whole block of the cache " * 3
    for _ in range(2):
        r = call(flagged, trust, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_server_defaults_for_request_fields(flagged: Server, trust: ssl.SSLContext) -> None:
    r = call(flagged, trust, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "logprobs": True})
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "bot"
    assert all(t["token"].startswith("token_id:") for t in choice["logprobs"]["content"])
    body = {"prompt": "hello", "max_tokens": 2, "stream": True}  # no stream_options: usage all the same
    with httpx.stream("POST", f"{flagged.url}/v1/completions", json=body, headers=AUTH, verify=trust) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 2


def test_a_trusted_request_template_with_the_default_kwargs_under_its_own(
    flagged: Server, trust: ssl.SSLContext
) -> None:
    def ids(text: str) -> list[int]:
        return call(flagged, trust, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()[
            "tokens"
        ]

    r = call(flagged, trust, "/tokenize", {"messages": HI, "chat_template": TEMPLATE})
    assert r.json()["tokens"] == ids("Ahoy hello")
    body = {"messages": HI, "chat_template": TEMPLATE, "chat_template_kwargs": {"greeting": "Hey"}}
    assert call(flagged, trust, "/tokenize", body).json()["tokens"] == ids("Hey hello")


def test_the_kv_cache_is_fp8_and_serves(flagged: Server, trust: ssl.SSLContext) -> None:
    out = flagged.output()
    assert (
        "KV blocks of 32 tokens (float8_e4m3fn)" in out and "KV cache in fp8_e4m3 with a scale of 1.0" in out
    )
    r = call(
        flagged, trust, "/v1/completions", {"prompt": "hello " * 40, "max_tokens": 8, "ignore_eos": True}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_per_request_metrics(flagged: Server, trust: ssl.SSLContext) -> None:
    """--enable-per-request-metrics: a one-prompt, n = 1 reply's timings, as vLLM derives them from when
    it was scheduled; in a stream, on the usage chunk; none for n = 2."""
    body = {"prompt": "hello " * 20, "max_tokens": 6, "ignore_eos": True}
    m = call(flagged, trust, "/v1/completions", body).json()["metrics"]
    assert set(m) == {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                      "tokens_per_second"}  # fmt: skip
    assert m["time_to_first_token_ms"] > 0 and m["queue_time_ms"] >= 0 and m["generation_time_ms"] > 0
    assert m["mean_itl_ms"] == pytest.approx(m["generation_time_ms"] / 5)
    inference_s = (m["time_to_first_token_ms"] + m["generation_time_ms"]) / 1000
    assert m["tokens_per_second"] == pytest.approx(6 / inference_s)
    assert "metrics" not in call(flagged, trust, "/v1/completions", {**body, "n": 2}).json()
    chat = {"messages": HI, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", f"{flagged.url}/v1/chat/completions", json=chat, headers=AUTH, verify=trust
    ) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [("metrics" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert (
        chunks[-1]["metrics"]["time_to_first_token_ms"] > 0 and chunks[-1]["usage"]["completion_tokens"] == 3
    )


def test_the_access_log_is_off_and_remote_code_is_named(flagged: Server) -> None:
    out = flagged.output()
    assert '"POST /tokenize' not in out and '"GET /v1/models' not in out
    assert "--trust-remote-code changes nothing" in out


def test_a_unix_socket_serves_the_sdk(tmp_path: Path, default_model_dir: Path) -> None:
    """--uds: the server listens on the socket (replacing a stale one) and nowhere else. No --api-key:
    VLLM_API_KEY's key is required, as vLLM requires it."""
    model = build_default_vocab(tmp_path / "tiny", default_model_dir)
    uds = tmp_path / "kiln.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(uds))
    stale.close()  # the file stays
    config = {"model": {"model": str(model), "max_model_len": 128}, "compile": {"mode": "eager"}}
    srv = start_server(tmp_path, config, uds=uds, env={"VLLM_API_KEY": "from-the-environment"})
    try:
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(uds)))
        assert http.get("http://localhost/v1/models").status_code == 401
        client = openai.OpenAI(
            base_url="http://localhost/v1", api_key="from-the-environment", http_client=http
        )
        [served] = client.models.list().data
        reply = client.completions.create(
            model=served.id, prompt="hello", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 3
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{srv.url}/health")  # its port is not open
        assert f"kiln is ready at unix:{uds}" in srv.output()
    finally:
        assert srv.stop() == 0, srv.output()


def test_an_untrusted_request_template_is_refused(tiny_server: Server) -> None:
    r = post(tiny_server, "/v1/chat/completions", json={"messages": HI, "chat_template": TEMPLATE})
    message = expect_error(r, 400, "BadRequestError", "chat_template")
    assert "--trust-request-chat-template is not set" in message


def test_tool_choice_none_shows_the_tools_by_default(flagged: Server, trust: ssl.SSLContext) -> None:
    """As vLLM: tool_choice "none" keeps the tools in the prompt unless the server runs with
    --exclude-tools-when-tool-choice-none (test_serve_ops)."""
    shows = "{% if tools %}{{ tools | length }} tools. {% endif %}{{ messages[0].content }}"
    body = {"messages": HI, "max_tokens": 1, "chat_template": shows}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    none = call(flagged, trust, "/v1/chat/completions", {**body, "tools": [tool], "tool_choice": "none"})
    shown = call(flagged, trust, "/tokenize", {"prompt": "1 tools. hello", "add_special_tokens": False})
    assert none.json()["usage"]["prompt_tokens"] == shown.json()["count"]


def test_content_parts_reach_the_template_as_it_reads_them(flagged: Server, trust: ssl.SSLContext) -> None:
    """As vLLM (--chat-template-content-format auto): a template that prints a message's content gets its
    text parts joined by newlines; one that loops over the content gets the list of parts (a string
    content as one part)."""

    def tokens(body: dict) -> list[int]:
        return call(flagged, trust, "/tokenize", {"add_special_tokens": False, **body}).json()["tokens"]

    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    printing = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    looping = "{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}"
    assert tokens({"messages": parts, "chat_template": printing}) == tokens({"prompt": "<a\nb>"})
    assert tokens({"messages": parts, "chat_template": looping}) == tokens({"prompt": "[a][b]"})
    assert tokens({"messages": HI, "chat_template": looping}) == tokens({"prompt": "[hello]"})
