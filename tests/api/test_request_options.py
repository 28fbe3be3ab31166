"""vLLM's request options beside sampling, over HTTP with the OpenAI SDK: request ids (body and
X-Request-Id), priority (body and X-Vllm-Priority), cache_salt, and the usage's cached tokens."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from transformers import AutoTokenizer

from kiln.api.chat_render import render_prompt
from kiln.api.protocol import ChatCompletionRequest
from kiln.config import EngineConfig
from kiln.engine.tokenizer import chat_template, load_tokenizer
from tests.api.server import AUTH, Server, expect_error, post
from tests.conftest import ALLOWED_ORIGIN, API_KEY, SECOND_KEY, TINY_NAME

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Hi"}]
# Over two 32-token blocks (the CPU's block size) of the default tokenizer.
LONG = " ".join(f"item {i} of a list that is long enough to fill whole cache blocks" for i in range(8))


def client_for(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_request_id_names_the_response(server: Server) -> None:
    client = client_for(server)
    r = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, extra_body={"request_id": "mine"}
    )
    assert r.id == "chatcmpl-mine"
    r = client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=2,
        extra_body={"request_id": "mine"},
        extra_headers={"X-Request-Id": "from-header"},  # the header wins, as in vLLM
    )
    assert r.id == "cmpl-from-header"
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=3, stream=True, extra_body={"request_id": "streamed"}
        )
    )
    assert chunks and {c.id for c in chunks} == {"cmpl-streamed"}
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", plain.id)
    # Without --enable-request-id-headers, responses carry no X-Request-Id.
    assert (
        "x-request-id" not in post(server, "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).headers
    )


def test_a_request_id_in_use_is_no_conflict(server: Server) -> None:
    """Clients reuse ids (retries, fan-out): the engine's own ids stay unique, as in vLLM."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def run() -> list[openai.types.Completion]:
        extra = {"request_id": "same", "ignore_eos": True}
        calls = [
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, extra_body=extra)
            for _ in range(4)
        ]
        return await asyncio.gather(*calls)

    outs = asyncio.run(run())
    assert [o.id for o in outs] == ["cmpl-same"] * 4
    assert all(o.usage.completion_tokens == 8 for o in outs)


def test_priority_needs_the_priority_policy(server: Server) -> None:
    body = {"prompt": "Hi", "max_tokens": 1}
    message = expect_error(
        post(server, "/v1/completions", json={**body, "priority": 3}), 400, "BadRequestError", "priority"
    )
    assert "--scheduling-policy priority" in message
    headers = {**AUTH, "X-Vllm-Priority": "3"}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    expect_error(r, 400, "BadRequestError", "priority")
    headers["X-Vllm-Priority"] = "soon"
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert "X-Vllm-Priority" in expect_error(r, 400, "BadRequestError", "priority")
    assert post(server, "/v1/completions", json={**body, "priority": 0}).status_code == 200


def test_priority_and_request_id_headers(tiny_server: Server) -> None:
    client = client_for(tiny_server)
    model = client.models.list().data[0].id
    r = client.chat.completions.with_raw_response.create(
        model=model,
        messages=HI,
        max_tokens=2,
        extra_body={"priority": -5},
        extra_headers={"X-Request-Id": "abc"},
    )
    assert r.headers["x-request-id"] == "abc" and r.parse().id == "chatcmpl-abc"
    r = client.completions.with_raw_response.create(
        model=model, prompt="Hi", max_tokens=2, extra_headers={"X-Vllm-Priority": "7"}
    )
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    assert r.parse().usage.completion_tokens == 2
    # Every response gets one, errors and the server's own endpoints too (vLLM's middleware).
    assert re.fullmatch(r"[0-9a-f]{32}", httpx.get(f"{tiny_server.url}/health").headers["x-request-id"])
    bad = post(tiny_server, "/v1/completions", json={"prompt": "Hi", "cache_salt": ""})
    expect_error(bad, 400, "BadRequestError", "cache_salt")
    assert "x-request-id" in bad.headers


@pytest.mark.parametrize("stream", [False, True])
def test_cache_salt_shares_the_prefix_cache_only_within_a_salt(tiny_server: Server, stream: bool) -> None:
    client = client_for(tiny_server)
    model = client.models.list().data[0].id
    tag = f"stream={stream}"  # each case its own prompt, so the other's cache is no hit

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        args = {"model": model, "prompt": f"{tag} {LONG}", "max_tokens": 1, "extra_body": extra}
        if not stream:
            usage = client.completions.create(**args).usage
        else:
            opts = {"include_usage": True}
            [*_, last] = client.completions.create(**args, stream=True, stream_options=opts)
            usage = last.usage
        assert usage.prompt_tokens > 64
        return usage.prompt_tokens_details.cached_tokens

    assert cached("alice") == 0
    assert cached("alice") >= 64
    assert cached("bob") == 0
    assert cached(None) == 0
    assert cached(None) >= 64


def test_beam_search(server: Server) -> None:
    client = client_for(server)
    prompt = "The history of the lighthouse begins"
    beams = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, n=3, logprobs=1,
        extra_body={"use_beam_search": True, "return_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in beams.choices] == [0, 1, 2]
    assert len({c.text for c in beams.choices}) == 3
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in beams.choices)
    # The best beam first: its tokens' logprobs sum highest.
    sums = [sum(c.logprobs.token_logprobs) for c in beams.choices]
    assert sums == sorted(sums, reverse=True)
    assert beams.usage.completion_tokens == 24
    # One beam is greedy decoding.
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    one = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, extra_body={"use_beam_search": True}
    )
    assert one.choices[0].text == greedy.choices[0].text
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=40, n=2,
        extra_body={"use_beam_search": True, "length_penalty": 1.0},
    )  # fmt: skip
    assert len(chat.choices) == 2 and "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"use_beam_search": True, "stream": True}, "stream"),
        ({"use_beam_search": True, "n": 11}, "n"),
        ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "stop": ["."]}, "stop"),
        ({"use_beam_search": True, "echo": True, "logprobs": 1}, "echo"),
        ({"length_penalty": 0.5}, "length_penalty"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(server: Server, extra: dict, param: str) -> None:
    r = post(server, "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **extra})
    expect_error(r, 400, "BadRequestError", param)


def test_reasoning_effort_reaches_the_template(default_model_dir: Path) -> None:
    """As vLLM: the template's reasoning_effort, and enable_thinking unless chat_template_kwargs set it."""
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.chat_template = (
        "{{ reasoning_effort }} {{ enable_thinking }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    )

    def rendered(**fields: object) -> str:
        body = msgspec.convert({"messages": HI, **fields}, ChatCompletionRequest)
        return tok.decode(render_prompt(tok, body.messages, body))

    assert rendered(reasoning_effort="low") == "low True|Hi"
    assert rendered(reasoning_effort="none") == "none False|Hi"
    assert rendered(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == "none True|Hi"
    assert rendered() == " |Hi"


def test_prompt_text_truncation_side_repetition_and_session(server: Server) -> None:
    client = client_for(server)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    template = httpx.post(f"{server.url}/tokenize", json={"messages": question}).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": template}).json()["prompt"]
    r = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=2,
        extra_body={"return_prompt_text": True, "session_id": "conversation-1", "reasoning_effort": "low"},
    )  # fmt: skip
    assert r.model_extra["prompt_text"] == text and text.endswith("assistant\n")
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=question, max_tokens=2, stream=True, extra_body={"return_prompt_text": True}
        )
    )
    assert chunks[0].model_extra["prompt_text"] == text
    assert all("prompt_text" not in (c.model_extra or {}) for c in chunks[1:])
    assert "prompt_text" not in (
        client.chat.completions.create(model=MODEL, messages=question, max_tokens=1).model_extra or {}
    )
    # truncation_side "right" keeps the prompt's first tokens.
    prompt = "one two three four five six seven eight"
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    for side, kept in (("left", ids[-3:]), ("right", ids[:3])):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1,
            extra_body={"truncate_prompt_tokens": 3, "truncation_side": side, "return_token_ids": True},
        )  # fmt: skip
        assert r.choices[0].prompt_token_ids == kept
    # A reply that loops ends at the loop, as vLLM's repetition_detection ends it.
    detect = {"max_pattern_size": 4, "min_count": 3}
    args = {"model": MODEL, "prompt": "1 1 1 1 1 1 1 1", "max_tokens": 40, "temperature": 0}
    looping = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert looping.choices[0].finish_reason == "length"
    r = client.completions.create(**args, extra_body={"ignore_eos": True, "repetition_detection": detect})
    assert (
        r.choices[0].finish_reason == "repetition"
        and r.choices[0].model_extra["stop_reason"] == "repetition_detected"
    )
    assert r.usage.completion_tokens < 40 and looping.choices[0].text.startswith(r.choices[0].text)
    bad = post(
        server, "/v1/completions", json={"prompt": "Hi", "repetition_detection": {"max_pattern_size": 2}}
    )
    expect_error(bad, 400, "BadRequestError", "repetition_detection")


def test_stream_interval_gathers_tokens_into_chunks(server: Server) -> None:
    client = client_for(server)
    args = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(**args)

    def chunk_tokens(**extra: object) -> tuple[list[int], str]:
        body = {"ignore_eos": True, "return_token_ids": True, **extra}
        chunks = list(client.completions.create(**args, stream=True, extra_body=body))
        sizes = [len(c.choices[0].token_ids) for c in chunks if c.choices and c.choices[0].token_ids]
        return sizes, "".join(c.choices[0].text for c in chunks if c.choices)

    sizes, text = chunk_tokens(stream_interval=4)
    assert text == whole.choices[0].text and sum(sizes) == 10
    # The first chunk goes at once, the last when the choice ends; those between hold 4 tokens or more.
    assert len(sizes) <= 4 and all(s >= 4 for s in sizes[1:-1])
    sizes, text = chunk_tokens()
    assert text == whole.choices[0].text and len(sizes) > 4
    bad = post(server, "/v1/completions", json={"prompt": "Hi", "stream": True, "stream_interval": 0})
    expect_error(bad, 400, "BadRequestError", "stream_interval")


def test_sagemaker_routes_and_token_strings(server: Server) -> None:
    """vLLM's /ping and /invocations (which routes a body by its kind), and /tokenize's token_strs."""
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{server.url}/ping").status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for body, kind in ((chat, "chat.completion"), ({"prompt": "Hi", "max_tokens": 2}, "text_completion"),
                       ({"input": "Hi", "max_output_tokens": 2}, "response")):  # fmt: skip
        r = post(server, "/invocations", json=body)
        assert r.status_code == 200 and r.json()["object"] == kind, r.text
    expect_error(post(server, "/invocations", json={"max_tokens": 2}), 400, "BadRequestError")
    expect_error(post(server, "/invocations", json={**chat, "n": 0}), 400, "BadRequestError", "n")
    assert httpx.post(f"{server.url}/invocations", json=chat).status_code == 401  # the API key, as /v1
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["token_strs"] == ["Hello", "Ġworld"] and len(r["tokens"]) == 2
    assert "token_strs" not in httpx.post(f"{server.url}/tokenize", json={"prompt": "Hi"}).json()


def test_cors_api_keys_and_quiet_endpoints(tiny_server: Server) -> None:
    """tiny_server allows one origin, takes either of two API keys, and leaves /health and /metrics out of
    its access log."""
    url = f"{tiny_server.url}/v1/completions"
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST"}
    r = httpx.options(url, headers={**preflight, "Access-Control-Request-Headers": "authorization"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    r = httpx.options(url, headers={**preflight, "Origin": "https://elsewhere.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    body = {"prompt": "Hi", "max_tokens": 1}
    for key in (API_KEY, SECOND_KEY):
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}", "Origin": ALLOWED_ORIGIN})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    expect_error(
        httpx.post(url, json=body, headers={"Authorization": "Bearer third"}), 401, "AuthenticationError"
    )
    httpx.get(f"{tiny_server.url}/health?probe=1")
    httpx.get(f"{tiny_server.url}/metrics")
    httpx.get(f"{tiny_server.url}/version")
    deadline = time.monotonic() + 10
    while '"GET /version' not in tiny_server.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = tiny_server.output()
    assert '"GET /version' in log and '"POST /v1/completions' in log
    assert '"GET /health' not in log and '"GET /metrics' not in log


def test_served_model_names_and_a_chat_template(
    tiny_server: Server, tmp_path: Path, default_model_dir: Path
) -> None:
    """A request may name the model by any of its served names; responses carry the first."""
    client = client_for(tiny_server)
    assert [m.id for m in client.models.list().data] == [TINY_NAME, "tiny-alias"]
    r = client.completions.create(model="tiny-alias", prompt="Hi", max_tokens=1)
    assert r.model == TINY_NAME
    expect_error(
        post(tiny_server, "/v1/completions", json={"model": "other", "prompt": "Hi"}),
        404,
        "NotFoundError",
        "model",
    )
    # vLLM's --chat-template: a file, or the template itself.
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert chat_template(str(tmp_path / "t.jinja")) == template == chat_template(template)
    config = EngineConfig.from_options(str(default_model_dir), chat_template=str(tmp_path / "t.jinja"))
    tokenizer = load_tokenizer(config, default_model_dir)
    assert tokenizer.apply_chat_template(HI, tokenize=False) == "<user>Hi"


def test_requests_are_logged_as_vllm_logs_them(tiny_server: Server, default_model_dir: Path) -> None:
    """--enable-log-requests with --max-log-len 5 (tiny_server's): each request's id, prompt text and ids,
    each cut to 5, and its params, logged as it is queued."""
    prompt = "one two three four five six seven eight"
    client = client_for(tiny_server)
    logged = {"request_id": "logged"}
    client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=3, extra_body=logged)
    line = next(s for s in tiny_server.output().splitlines() if "Received request cmpl-logged:" in s)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer.encode(prompt)[:5]
    assert f"prompt: {tokenizer.decode(ids)[:5]!r}, params: SamplingParams(" in line
    assert "max_tokens=3" in line and line.endswith(f"prompt_token_ids: {ids}")


@pytest.mark.parametrize("stream", [False, True])
def test_outputs_are_logged_as_vllm_logs_them(tiny_server: Server, stream: bool) -> None:
    """--enable-log-outputs (tiny_server's, max_log_len 5): each finished choice's text and ids, cut to 5,
    and its finish reason, streamed or whole."""
    client = client_for(tiny_server)
    rid = f"out-{stream}"
    args = dict(model=TINY_NAME, prompt="Hi", max_tokens=8, n=2, temperature=1.0, seed=3, stream=stream)
    r = client.completions.create(**args, extra_body={"request_id": rid, "ignore_eos": True})
    if stream:
        texts = ["", ""]
        for chunk in r:
            for c in chunk.choices:
                texts[c.index] += c.text
    else:
        texts = [c.text for c in r.choices]
    log = tiny_server.output()
    for i, text in enumerate(texts):
        line = next(s for s in log.splitlines() if f"Generated response cmpl-{rid} (choice {i}):" in s)
        assert f"output: {text[:5]!r}, output_token_ids: [" in line and line.endswith("finish_reason: length")
        ids = line.split("output_token_ids: [")[1].split("]")[0].split(", ")
        assert len(ids) == 5


def test_the_engine_line_reports_throughput(tiny_server: Server) -> None:
    """vLLM's periodic line (tiny_server's every 0.5 s): a span with generated tokens reports them."""
    client = client_for(tiny_server)
    client.completions.create(model=TINY_NAME, prompt="Hi", max_tokens=40, extra_body={"ignore_eos": True})
    pattern = re.compile(
        r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
        r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%"
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rates = [float(m[1]) for m in pattern.finditer(tiny_server.output())]
        if any(rates):
            break
        time.sleep(0.2)
    assert any(rates), tiny_server.output()[-2000:]


def test_an_earlier_reply_goes_back_whole(tiny_server: Server, default_model_dir: Path) -> None:
    """A reasoning parser's reply, sent back in the next turn as the SDK sends it (its `reasoning`, or
    vLLM's older `reasoning_content`), and a message's `name`, reach the template, as vLLM gives them."""
    client = client_for(tiny_server)
    body = {"structured_outputs": {"choice": ["<think>Two and two.</think>Four."]}}
    first = (
        client.chat.completions.create(
            model=TINY_NAME, messages=HI, max_tokens=30, temperature=0, extra_body=body
        )
        .choices[0]
        .message
    )
    assert first.reasoning == "Two and two."  # type: ignore[attr-defined]
    again = client.chat.completions.create(
        model=TINY_NAME, messages=[*HI, first, {"role": "user", "content": "Sure?"}], max_tokens=1
    )
    assert again.choices[0].finish_reason == "length"
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.chat_template = (
        "{% for m in messages %}{{ m.name }}:{{ m.reasoning_content }}:{{ m.reasoning }}|{% endfor %}"
    )
    for field in ("reasoning", "reasoning_content"):
        messages = [{"role": "user", "content": "Hi", "name": "ann"}, {"role": "assistant", field: "hmm"}]
        parsed = msgspec.convert({"messages": messages}, ChatCompletionRequest)
        assert tok.decode(render_prompt(tok, parsed.messages, parsed)) == "ann::|:hmm:hmm|"
