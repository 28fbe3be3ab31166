"""POST /v1/responses with the OpenAI SDK's `client.responses` against a real server: the same replies as
the chat path, whole and streamed (the SDK's stream helper checks the events' order), output items for
reasoning, messages and function calls, and 4xx for what kiln does not do."""

from __future__ import annotations

import json

import msgspec
import openai
import pytest

from kiln.api.responses_api import to_chat
from kiln.api.responses_protocol import ResponsesRequest
from tests.api.server import Server, expect_error, post
from tests.api.test_structured import ASK_WEATHER, CALL, WEATHER
from tests.conftest import API_KEY

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's tools are flat


def client_for(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_a_response_is_the_chat_reply(server: Server) -> None:
    client = client_for(server)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    r = client.responses.create(
        model=MODEL, instructions="Be brief.", input=QUESTION, max_output_tokens=24, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.store is False
    # Message items (text parts, an earlier assistant turn) are a conversation.
    turns = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": QUESTION},
    ]
    r = client.responses.create(model=MODEL, input=turns, max_output_tokens=8, temperature=0)
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]
    messages.append({"role": "user", "content": QUESTION})
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    # Cut short: incomplete, and why.
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_response(server: Server) -> None:
    client = client_for(server)
    args = {"model": MODEL, "input": QUESTION, "max_output_tokens": 24, "temperature": 0}
    whole = client.responses.create(**args)
    with client.responses.stream(**args) as stream:  # the SDK's helper: it checks each event's place
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_calls_and_json_output(server: Server, stream: bool) -> None:
    client = client_for(server)
    args = {
        "model": MODEL, "input": ASK_WEATHER, "max_output_tokens": 60, "temperature": 0, "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }  # fmt: skip
    if stream:
        with client.responses.stream(**args) as s:
            events = list(s)
            r = s.get_final_response()
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
    else:
        r = client.responses.create(**args)
    [call] = r.output
    assert (
        call.type == "function_call"
        and call.name == "get_weather"
        and call.call_id.startswith("chatcmpl-tool")
    )
    assert set(json.loads(call.arguments)) == {"city", "unit"}
    # The call and its output, sent back, are the next turn's conversation.
    turn = [*ASK_WEATHER, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                           "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]  # fmt: skip
    r = client.responses.create(
        model=MODEL, input=turn, max_output_tokens=8, temperature=0, tools=[TOOL], tool_choice="none"
    )
    assert r.status in ("completed", "incomplete") and r.output_text
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema}}
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0, text=fmt)
    assert set(json.loads(r.output_text)) == {"capital"}


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_its_own_item(tiny_server: Server, stream: bool) -> None:
    """With a reasoning parser (tiny_server's qwen3), the thinking is a reasoning item before the message;
    the text is forced by a constraint, as the random model writes none of its own."""
    client = client_for(tiny_server)
    model = client.models.list().data[0].id
    text = "<think>The user asks for 2+2.</think>It is 4."
    args = {
        "model": model, "input": "2+2?", "max_output_tokens": 60, "temperature": 0,
        "extra_body": {"structured_outputs": {"choice": [text]}},
    }  # fmt: skip
    if stream:
        with client.responses.stream(**args) as s:
            kinds = [e.type for e in s]
            r = s.get_final_response()
        assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    else:
        r = client.responses.create(**args)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user asks for 2+2."
    assert message.type == "message" and r.output_text == "It is 4."
    assert r.usage.output_tokens_details.reasoning_tokens > 0


def test_output_text_logprobs(server: Server) -> None:
    client = client_for(server)
    r = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0, top_logprobs=2,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == r.output_text


@pytest.mark.parametrize(
    "extra, status, param",
    [
        ({"previous_response_id": "resp_123"}, 404, "previous_response_id"),
        ({"background": True}, 400, "background"),
        ({"truncation": "auto"}, 400, "truncation"),
        ({"reasoning": {"summary": "auto"}}, 400, "reasoning"),
        ({"top_logprobs": 2}, 400, "top_logprobs"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
        ({"input": [{"type": "web_search_call"}]}, 400, "input"),
        ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text"),
    ],
)
def test_what_kiln_does_not_do_is_refused(server: Server, extra: dict, status: int, param: str) -> None:
    r = post(server, "/v1/responses", json={"input": QUESTION, "max_output_tokens": 2, **extra})
    expect_error(r, status, "NotFoundError" if status == 404 else "BadRequestError", param)


def test_auto_tool_calls_in_a_response(tiny_server: Server) -> None:
    """tool_choice "auto" (the Responses API's default) with the hermes parser: calls as items."""
    client = client_for(tiny_server)
    model = client.models.list().data[0].id
    r = client.responses.create(
        model=model, input=ASK_WEATHER, tools=[TOOL], max_output_tokens=120, temperature=0,
        extra_body={"structured_outputs": {"choice": [f"Let me check. {CALL}"]}},
    )  # fmt: skip
    message, call = r.output
    assert message.type == "message" and r.output_text == "Let me check. "
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}


def test_a_reasoning_item_goes_back_with_the_turn_after_it() -> None:
    """As the SDK sends a conversation back: a reasoning item's text becomes the next assistant message's
    `reasoning` (which reaches the template); one before a user message is left out."""
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    thinking = {"type": "reasoning", "id": "rs_1", "summary": [],
                "content": [{"type": "reasoning_text", "text": "Ask the tool."}]}  # fmt: skip
    items = [
        {"role": "user", "content": "Weather?"}, thinking, call,
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {**thinking, "content": [{"type": "reasoning_text", "text": "Dropped."}]},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    chat = to_chat(msgspec.convert({"input": items}, ResponsesRequest))
    assert [(m.role, m.reasoning) for m in chat.messages] == [
        ("user", None), ("assistant", "Ask the tool."), ("tool", None), ("user", None),
    ]  # fmt: skip
