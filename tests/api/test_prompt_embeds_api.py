"""/v1/completions' prompt_embeds (--enable-prompt-embeds), through the OpenAI SDK as vLLM's docs send them:
base64 torch.save'd tensors in extra_body, and chat's {"type": "prompt_embeds"} content parts. A token's own
embedding rows generate what its ids do; every bad payload is a 400 naming its field, and the server goes
on."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

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
    part = {"type": "prompt_embeds", "data": encode(torch.zeros(3, 576))}
    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
    message = expect_error(
        post(server, "/v1/chat/completions", json=body), 400, "BadRequestError", "messages"
    )
    assert message == "You must set `--enable-prompt-embeds` to input `prompt_embeds`"
    assert httpx.get(f"{server.url}/health").status_code == 200


def chat(client: openai.OpenAI, content: object, **kwargs: object) -> openai.types.chat.ChatCompletion:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    return client.chat.completions.create(
        model=TINY_NAME, messages=messages, max_tokens=8, temperature=0, **kwargs
    )  # type: ignore[arg-type]


def test_chat_parts_splice_their_rows_where_they_stand(
    client: openai.OpenAI, weight: torch.Tensor, tiny_model_dir: Path, tiny_server: Server
) -> None:
    """The rows of "Paris is" in a user message give what the words do: the template's ids around them, the
    parts' text joined by newlines as vLLM joins them."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    words = tokenizer.encode("Paris is", add_special_tokens=False)
    by_text = chat(client, "Hi\nParis is")
    part = {"type": "prompt_embeds", "data": encode(weight[words])}
    extra = {"request_id": "spliced", "return_token_ids": True}
    got = chat(client, [{"type": "text", "text": "Hi"}, part], extra_body=extra)
    assert got.choices[0].message.content == by_text.choices[0].message.content
    assert got.usage.prompt_tokens == by_text.usage.prompt_tokens
    line = next(s for s in tiny_server.output().splitlines() if "Received request chatcmpl-spliced:" in s)
    start = line.index("prompt_embeds at: [(") + len("prompt_embeds at: [(")
    first = int(line[start : line.index(",", start)])
    assert f"prompt_embeds at: [({first}, ({len(words)}, 64))]" in line
    assert got.prompt_token_ids[first : first + len(words)] == [0] * len(words)  # type: ignore[attr-defined]
    # Two parts, streamed, the rest of the prompt cut away by truncate_prompt_tokens (its last 3 rows: the
    # template's).
    halves = [{"type": "prompt_embeds", "data": encode(weight[words[:1]])}, {"type": "text", "text": "x"}]
    stream = chat(client, [*halves, part], stream=True, extra_body={"truncate_prompt_tokens": 3})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    tail = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    ), add_special_tokens=False)[-3:]  # fmt: skip
    assert text == complete(client, prompt=tail).choices[0].text


def test_bad_chat_parts_are_400s(tiny_server: Server, weight: torch.Tensor) -> None:
    rows = encode(weight[IDS])
    part = {"type": "prompt_embeds", "data": rows}
    bad = [
        ([{"type": "prompt_embeds"}], {}),
        ([{"type": "prompt_embeds", "data": encode(torch.zeros(3, 65))}], {}),
        ([{"type": "prompt_embeds", "data": rows, "text": "x"}], {}),
        ([{"type": "text", "text": "x", "data": rows}], {}),
        ([{"type": "text", "text": "<prompt_embeds>"}, part], {}),
        ([{"type": "input_audio"}], {}),
        ([part], {"echo": True, "messages_role": "assistant"}),
        ([part], {"prompt_logprobs": 1}),
        ([part], {"return_prompt_text": True}),
        ([part], {"use_beam_search": True, "n": 2}),
    ]
    messages = []
    for content, extra in bad:
        role = extra.pop("messages_role", "user")
        body = {
            "model": TINY_NAME,
            "max_tokens": 2,
            "messages": [{"role": role, "content": content}],
            **extra,
        }
        if role == "assistant":
            body |= {"add_generation_prompt": False, "continue_final_message": True}
        r = post(tiny_server, "/v1/chat/completions", json=body)
        param = next(iter(extra), "messages")
        messages.append(expect_error(r, 400, "BadRequestError", param))
    assert messages[0] == (
        "prompt_embeds content part requires a non-empty `data` field with base64-encoded tensor bytes."
    )
    assert messages[1] == (
        "messages[0].content[0]: `prompt_embeds` hidden_size 65 does not match the model's hidden_size 64."
    )
    assert messages[2] == "messages[0].content[0]: a prompt_embeds part takes no `text`"
    assert messages[3] == "messages[0].content[0]: a text part takes no `data`"
    assert "may not contain the reserved placeholder '<prompt_embeds>'" in messages[4]
    assert "only text and prompt_embeds content parts are supported, not 'input_audio'" in messages[5]
    assert messages[6] == "Echo is unsupported with prompt embeds."
    assert messages[7] == "prompt_logprobs is not compatible with prompt embeds."
    # Other endpoints that render chats take token ids only.
    tokenize = {"model": TINY_NAME, "messages": [{"role": "user", "content": [part]}]}
    message = expect_error(post(tiny_server, "/tokenize", json=tokenize), 400, "BadRequestError", "messages")
    assert message == "prompt_embeds content parts are taken by /v1/chat/completions alone"
    ok = {"model": TINY_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]}
    assert post(tiny_server, "/v1/chat/completions", json=ok).status_code == 200
