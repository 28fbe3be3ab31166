"""/v1/completions' prompt_embeds (--enable-prompt-embeds), through the OpenAI SDK as vLLM's docs send them:
base64 torch.save'd tensors in extra_body. A token's own embedding rows generate what its ids do; every bad
payload is a 400 naming prompt_embeds, and the server goes on."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from tests.api.server import Server, expect_error, post
from tests.conftest import API_KEY, TINY_MAX_MODEL_LEN, TINY_NAME

pytestmark = pytest.mark.slow

IDS = [504, 3575, 282, 4649, 314]


@pytest.fixture(scope="module")
def client(tiny_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def weight(tiny_model_dir: Path) -> torch.Tensor:
    return load_file(tiny_model_dir / "model.safetensors")["model.embed_tokens.weight"]


def encode(value: object) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def complete(client: openai.OpenAI, **kwargs: object) -> openai.types.Completion:
    return client.completions.create(model=TINY_NAME, max_tokens=8, temperature=0, **kwargs)  # type: ignore[call-overload]


def test_embedding_rows_generate_what_their_ids_do(
    client: openai.OpenAI, weight: torch.Tensor, tiny_server: Server
) -> None:
    by_ids = complete(client, prompt=IDS)
    body = {"prompt_embeds": encode(weight[IDS]), "request_id": "embeds"}
    got = complete(client, prompt="", extra_body=body)
    assert got.choices[0].text == by_ids.choices[0].text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(IDS) and got.usage.completion_tokens == 8
    # tiny_server logs requests (--enable-log-requests): the rows' shape, not their placeholder ids.
    line = next(s for s in tiny_server.output().splitlines() if "Received request cmpl-embeds:" in s)
    assert f"prompt_embeds shape: ({len(IDS)}, 64), params: SamplingParams(" in line
    sparse = complete(client, prompt="", extra_body={"prompt_embeds": encode(weight[IDS].to_sparse())})
    assert sparse.choices[0].text == by_ids.choices[0].text
    # A batch of one, in bfloat16, without `prompt` at all; the last 3 rows kept.
    tail = complete(client, prompt=IDS[-3:])
    body = {"prompt_embeds": encode(weight[IDS][None].to(torch.bfloat16)), "truncate_prompt_tokens": 3}
    got = client.completions.create(
        model=TINY_NAME, max_tokens=8, temperature=0, extra_body=body, prompt=None
    )  # type: ignore[call-overload]
    assert got.choices[0].text == tail.choices[0].text and got.usage.prompt_tokens == 3


def test_embeds_come_first_then_the_prompts(client: openai.OpenAI, weight: torch.Tensor) -> None:
    first, second = IDS[:3], IDS[2:]
    body = {"prompt_embeds": [encode(weight[first]), encode(weight[second])]}
    got = complete(client, prompt="France", extra_body=body)
    assert [c.index for c in got.choices] == [0, 1, 2]
    expected = [complete(client, prompt=p).choices[0].text for p in (first, second, "France")]
    assert [c.text for c in got.choices] == expected
    stream = complete(client, prompt="", stream=True, extra_body={"prompt_embeds": encode(weight[first])})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[0]


def test_bad_payloads_are_400s(tiny_server: Server, weight: torch.Tensor) -> None:
    rows = weight[IDS]
    hidden = rows.shape[1]
    bad = [
        ({"prompt_embeds": "not base64!"}, "prompt_embeds"),
        ({"prompt_embeds": base64.b64encode(b"no pickle").decode()}, "prompt_embeds"),
        ({"prompt_embeds": encode({"rows": rows})}, "prompt_embeds"),
        ({"prompt_embeds": encode(torch.zeros(3, hidden + 1))}, "prompt_embeds"),
        ({"prompt_embeds": encode(torch.zeros(2, 3, hidden))}, "prompt_embeds"),
        ({"prompt_embeds": encode(torch.zeros(3, hidden, dtype=torch.int32))}, "prompt_embeds"),
        ({"prompt_embeds": encode(torch.zeros(TINY_MAX_MODEL_LEN, hidden))}, "max_tokens"),
        ({"prompt_embeds": encode(rows), "echo": True}, "echo"),
        ({"prompt_embeds": encode(rows), "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt_embeds": encode(rows), "use_beam_search": True, "n": 2}, "use_beam_search"),
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
    ]
    messages = []
    for body, param in bad:
        r = post(tiny_server, "/v1/completions", json={"model": TINY_NAME, "max_tokens": 2, **body})
        messages.append(expect_error(r, 400, "BadRequestError", param))
    assert "did not deserialize to a torch.Tensor" in messages[2]
    assert "hidden_size 65 does not match the model's hidden_size 64" in messages[3]
    assert "must be a 2D tensor of shape (num_tokens, hidden_size); got shape (2, 3, 64)" in messages[4]
    assert "torch.int32 is not a floating-point type" in messages[5]
    assert messages[7] == "Echo is unsupported with prompt embeds."
    assert messages[10] == messages[11] == "Either prompt or prompt_embeds must be provided and non-empty."
    r = post(tiny_server, "/v1/completions", json={"model": TINY_NAME, "prompt": IDS, "max_tokens": 2})
    assert r.status_code == 200


def test_refused_where_not_enabled(server: Server) -> None:
    body = {"prompt": "", "prompt_embeds": encode(torch.zeros(3, 576)), "max_tokens": 2}
    r = post(server, "/v1/completions", json=body)
    message = expect_error(r, 400, "BadRequestError", "prompt_embeds")
    assert message == "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
    assert httpx.get(f"{server.url}/health").status_code == 200
