"""A reasoning model's thinking over HTTP with the OpenAI SDK: a forced tool call follows the thinking
(as vLLM: the call's constraint holds only the answer), and thinking_token_budget ends the thinking. A
tiny random model whose tokenizer has <think> and </think> as single tokens, as Qwen3's has, served with
the qwen3 parser; a logit bias draws it to <think>, which it would not write on its own. Its tokenizer
also has Mistral's special [TOOL_CALLS], for the mistral tool parser's special-token text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.api.server import Server, expect_error, post, start_server
from tests.conftest import API_KEY
from tests.models.tiny import build_default_vocab

pytestmark = pytest.mark.slow

UNIT = {
    "type": "function",
    "function": {
        "name": "pick_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Which unit?"}]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model's name, on the `server` fixture


@pytest.fixture(scope="module")
def think_model(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("tiny-think")
    added, special = ("<think>", "</think>"), ("[TOOL_CALLS]",)
    return build_default_vocab(path, default_model_dir, added=added, special=special)


@pytest.fixture(scope="module")
def think_server(tmp_path_factory: pytest.TempPathFactory, think_model: Path) -> Iterator[Server]:
    config = {
        "model": {"model": str(think_model), "max_model_len": 256, "reasoning_parser": "qwen3"},
        "cache": {"kv_cache_gib": 0.02},
        "compile": {"mode": "eager"},
        "server": {"api_key": API_KEY, "enable_auto_tool_choice": True, "tool_call_parser": "mistral"},
    }
    srv = start_server(tmp_path_factory.mktemp("serve-think"), config)
    yield srv
    assert srv.stop() == 0, srv.output()


def whitespace(model: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    return [i for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_follows_the_thinking_its_budget_ends(
    think_server: Server, think_model: Path, stream: bool
) -> None:
    client = openai.OpenAI(base_url=f"{think_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    (think,) = post(think_server, "/tokenize", json={"prompt": "<think>"}).json()["tokens"]
    # Drawn to <think>; kept from whitespace, which the call's JSON allows and a random model repeats.
    bias = {str(think): 100} | {str(t): -100 for t in whitespace(think_model)}
    args = dict(
        model=model, messages=ASK, tools=[UNIT], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "pick_unit"}},
        logit_bias=bias, extra_body={"thinking_token_budget": 2},
    )  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **args))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
        calls = [call for d in deltas for call in d.tool_calls or []]
        name = "".join(c.function.name or "" for c in calls if c.function)
        arguments = "".join(c.function.arguments or "" for c in calls if c.function)
        ids = [c.id for c in calls if c.id]
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert not any(d.content for d in deltas)
    else:
        choice = client.chat.completions.create(**args).choices[0]
        reasoning, reason = choice.message.reasoning, choice.finish_reason  # type: ignore[attr-defined]
        (call,) = choice.message.tool_calls
        name, arguments, ids = call.function.name, call.function.arguments, [call.id]
        assert choice.message.content is None
    assert reasoning == "<think><think>"  # the two tokens of its budget, drawn to <think> by the bias
    assert name == "pick_unit" and json.loads(arguments)["unit"] in ("celsius", "fahrenheit")
    assert reason == "tool_calls"
    # The server's tool parser is mistral: the call's id is one Mistral's templates take back.
    assert len(ids) == 1 and re.fullmatch("[A-Za-z0-9]{9}", ids[0])


def test_the_mistral_parser_reads_its_special_tag(think_server: Server) -> None:
    """The tag the mistral parser reads is a special token: tool_choice "auto" keeps special tokens in the
    text (as vLLM), and what follows the tag, not calls here, stays in the content as written."""
    client = openai.OpenAI(base_url=f"{think_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    (tag,) = post(think_server, "/tokenize", json={"prompt": "[TOOL_CALLS]"}).json()["tokens"]
    args = dict(
        model=client.models.list().data[0].id, messages=ASK, max_tokens=3, temperature=0,
        logit_bias={str(tag): 100},
    )  # fmt: skip
    choice = client.chat.completions.create(tools=[UNIT], **args).choices[0]
    assert choice.message.content == "[TOOL_CALLS]" * 3 and not choice.message.tool_calls
    assert choice.finish_reason == "length"
    assert not client.chat.completions.create(**args).choices[0].message.content  # without tools: skipped


def test_a_budget_without_a_reasoning_parser_is_a_400(server: Server) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "thinking_token_budget": 5}
    message = expect_error(
        post(server, "/v1/completions", json=body), 400, "BadRequestError", "thinking_token_budget"
    )
    assert message == "thinking_token_budget needs a reasoning parser (--reasoning-parser)"
