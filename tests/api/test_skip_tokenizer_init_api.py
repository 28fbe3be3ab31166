"""kiln serve --skip-tokenizer-init on a model folder without a tokenizer: completions take token ids and
give token ids (return_token_ids) with empty text, as transformers generates them; every endpoint or field
that needs text is a 400 naming why, and the server goes on."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import torch

from tests.api.server import Server, expect_error, post, start_server
from tests.models.test_skip_tokenizer_init import IDS, without_tokenizer
from tests.models.tiny import build

pytestmark = pytest.mark.slow

NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, torch.nn.Module]]:
    path = tmp_path_factory.mktemp("tiny-no-tokenizer")
    hf = build("llama", path)
    config = {
        "model": {"model": str(without_tokenizer(path)), "dtype": "float32"},
        "cache": {"kv_cache_gib": 0.01},
        "compile": {"mode": "eager"},
        "server": {"enable_log_requests": True},
    }
    srv = start_server(tmp_path_factory.mktemp("serve-no-tokenizer"), config, "--skip-tokenizer-init")
    yield srv, hf
    assert srv.stop() == 0, srv.output()


def test_ids_in_ids_out(served: tuple[Server, torch.nn.Module]) -> None:
    srv, hf = served
    with torch.no_grad():
        ref = hf.generate(torch.tensor([IDS]), do_sample=False, max_new_tokens=8, min_new_tokens=8)
    body = {
        "prompt": IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        "logprobs": 1,
    }  # fmt: skip
    choice = post(srv, "/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "" and choice["token_ids"] == ref[0, len(IDS) :].tolist()
    assert choice["prompt_token_ids"] == IDS
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    streamed = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["token_ids"] or []
    assert streamed == choice["token_ids"]
    log = srv.output()
    assert "prompt: None, params: SamplingParams(" in log  # the request log names no text
    assert f"try: curl {srv.url}/v1/completions" in log  # not the chat the start-up log suggests elsewhere


def test_what_needs_text_is_a_400(served: tuple[Server, torch.nn.Module]) -> None:
    srv, _ = served
    hi = [{"role": "user", "content": "hi"}]
    for path, body in [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
        ("/v1/completions", {"prompt": IDS, "max_tokens": 2, "echo": True}),
        ("/v1/chat/completions", {"messages": hi, "max_tokens": 2}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
        ("/tokenize", {"prompt": "hello"}),
        ("/detokenize", {"tokens": IDS}),
    ]:
        assert expect_error(post(srv, path, json=body), 400, "BadRequestError") == NO_TOKENIZER, path
    model = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
    r = post(srv, "/v1/messages", json={"model": model, "messages": hi, "max_tokens": 2})  # Anthropic's shape
    assert r.status_code == 400 and r.json()["error"]["message"] == NO_TOKENIZER
    for field, value in [("stop", ["x"]), ("bad_words", ["x"]), ("response_format", {"type": "json_object"})]:
        r = post(srv, "/v1/completions", json={"prompt": IDS, "max_tokens": 2, field: value})
        assert "skip_tokenizer_init" in expect_error(r, 400, "BadRequestError", field)
    assert post(srv, "/v1/completions", json={"prompt": IDS, "max_tokens": 2}).status_code == 200
