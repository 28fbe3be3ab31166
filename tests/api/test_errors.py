"""Every bad input gets its status and an OpenAI-style error body, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.server import AUTH, Server, expect_error, post
from tests.conftest import API_KEY, MAX_MODEL_LEN, MAX_REQUEST_BYTES

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": 12}, "prompt"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stream": "yes"}, "stream"),
    ],
)
def test_wrong_type(server: Server, path: str, body: dict, param: str) -> None:
    message = expect_error(post(server, path, json=body), 400, "BadRequestError", param)
    assert param in message


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [99999999]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": ["w"] * 129}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_out_of_range(server: Server, body: dict, param: str) -> None:
    expect_error(post(server, "/v1/completions", json={"prompt": "x", **body}), 400, "BadRequestError", param)


def test_bad_json(server: Server) -> None:
    r = post(server, "/v1/chat/completions", content=b'{"messages": [')
    assert "not valid JSON" in expect_error(r, 400, "BadRequestError")


def test_empty_messages_and_prompts(server: Server) -> None:
    expect_error(
        post(server, "/v1/chat/completions", json={"messages": []}), 400, "BadRequestError", "messages"
    )
    expect_error(post(server, "/v1/completions", json={"prompt": []}), 400, "BadRequestError", "prompt")
    expect_error(
        post(server, "/v1/completions", json={"prompt": [[1], "a"]}), 400, "BadRequestError", "prompt"
    )
    r = post(server, "/v1/chat/completions", json={"messages": MESSAGES, "top_logprobs": 2})
    expect_error(r, 400, "BadRequestError", "top_logprobs")
    for k in (-1, 21):
        r = post(
            server, "/v1/chat/completions", json={"messages": MESSAGES, "logprobs": True, "top_logprobs": k}
        )
        expect_error(r, 400, "BadRequestError", "top_logprobs")


def test_too_long(server: Server) -> None:
    r = post(server, "/v1/completions", json={"prompt": [1] * 500, "max_tokens": 100})
    message = expect_error(r, 400, "BadRequestError", "max_tokens")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message
    r = post(
        server, "/v1/chat/completions", json={"messages": MESSAGES, "max_completion_tokens": MAX_MODEL_LEN}
    )
    expect_error(r, 400, "BadRequestError", "max_tokens")
    long_chat = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]  # no max_tokens: the prompt alone
    r = post(server, "/v1/chat/completions", json={"messages": long_chat})
    assert "leaves no room" in expect_error(r, 400, "BadRequestError")


def test_api_key(server: Server) -> None:
    expect_error(httpx.get(f"{server.url}/v1/models"), 401, "AuthenticationError")
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    expect_error(r, 401, "AuthenticationError")
    assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": API_KEY})
    expect_error(r, 401, "AuthenticationError")
    assert httpx.get(f"{server.url}/health").status_code == 200  # only /v1/* is guarded
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_not_found(server: Server) -> None:
    r = post(server, "/v1/chat/completions", json={"model": "gpt-4", "messages": MESSAGES})
    assert expect_error(r, 404, "NotFoundError", "model") == (
        "The model `gpt-4` does not exist. Valid aliases: HuggingFaceTB/SmolLM2-135M-Instruct."
    )
    expect_error(httpx.get(f"{server.url}/v1/nothing", headers=AUTH), 404, "NotFoundError")
    expect_error(httpx.get(f"{server.url}/v1/completions", headers=AUTH), 405, "MethodNotAllowedError")
    with pytest.raises(openai.NotFoundError):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        client.completions.create(model="nope", prompt="x")


def test_body_too_large(server: Server) -> None:
    big = {"prompt": "word " * MAX_REQUEST_BYTES}
    expect_error(post(server, "/v1/completions", json=big), 413, "RequestTooLargeError")

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1024 + 1):
            yield b"a" * 1024
        yield b'"}'

    expect_error(post(server, "/v1/completions", content=chunked()), 413, "RequestTooLargeError")


def test_server_still_serves(server: Server) -> None:
    r = post(server, "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
