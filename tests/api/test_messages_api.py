"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, as vLLM serves it) with the
Anthropic SDK against a real server: the chat path's replies as content blocks, whole and streamed (the
SDK's stream helper checks the events' order), forced and parsed tool calls, thinking, JSON output, the
token count, and Anthropic-shaped errors for what kiln refuses."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import httpx
import msgspec
import openai
import pytest
from transformers import AutoTokenizer

from kiln.api.errors import APIError
from kiln.api.messages import to_chat
from kiln.api.messages_protocol import ClearedToolUses, MessagesRequest, ThinkingConfig
from kiln.api.template_traits import TemplateTraits, template_traits
from kiln.server_config import ServerConfig
from tests.api.server import Server, post
from tests.api.test_structured import CALL, WEATHER
from tests.conftest import API_KEY

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
TOOL = {  # WEATHER, as Anthropic declares a tool
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK no longer sends temperature; vLLM and kiln take it


def client_for(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def chat_for(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_a_message_is_the_chat_reply(server: Server) -> None:
    chat = chat_for(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    # The billing header Claude Code puts first changes every request: it is left out of the prompt.
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
        {"type": "text", "text": "Be brief."},
    ]
    args = {
        "model": MODEL,
        "max_tokens": 24,
        "system": system,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    m = client_for(server).messages.create(**args, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    [block] = m.content
    assert block.type == "text" and block.text == chat.choices[0].message.content and "Paris" in block.text
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    assert (m.usage.input_tokens, m.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    # The wire shape: Anthropic's keys, and no cache figures without --enable-prompt-tokens-details.
    raw = post(server, "/v1/messages", json={**args, "temperature": 0}).json()
    assert list(raw) == ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"]
    assert raw["usage"] == {
        "input_tokens": chat.usage.prompt_tokens,
        "output_tokens": chat.usage.completion_tokens,
    }
    count = client_for(server).messages.count_tokens(model=MODEL, system=system, messages=args["messages"])
    assert count.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_message(server: Server) -> None:
    client = client_for(server)
    args = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": QUESTION}], **GREEDY}
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:  # the SDK's helper: it checks each event's place
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )
    # On the wire: each event's type also on its `event:` line, and no `data: [DONE]` at the end.
    body = {**args.pop("extra_body"), **args, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}) as r:
        frames = [f for f in r.read().decode().split("\n\n") if f]
    for frame in frames:
        event, data = frame.split("\n")
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]
    assert frames[-1] == 'event: message_stop\ndata: {"type":"message_stop"}'


def test_stop_reasons(server: Server) -> None:
    client = client_for(server)
    ask = [{"role": "user", "content": "Say hello!"}]
    m = client.messages.create(model=MODEL, max_tokens=30, messages=ask, stop_sequences=["!"], **GREEDY)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "!") and "!" not in m.content[0].text
    m = client.messages.create(model=MODEL, max_tokens=2, messages=ask, **GREEDY)
    assert (m.stop_reason, m.usage.output_tokens) == ("max_tokens", 2)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_use_and_its_result(server: Server, stream: bool, choice: dict) -> None:
    client = client_for(server)
    args = {
        "model": MODEL,
        "max_tokens": 80,
        "messages": ASK,
        "tools": [TOOL],
        "tool_choice": choice,
        **GREEDY,
    }
    if stream:
        with client.messages.stream(**args) as s:
            kinds = [e.type for e in s]
            m = s.get_final_message()
        assert "input_json" in kinds
    else:
        m = client.messages.create(**args)
    [call] = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and m.stop_reason == "tool_use"
    assert set(call.input) == {"city", "unit"}
    # The call and its result, sent back, are the next turn.
    turn = [
        *ASK,
        {"role": "assistant", "content": [call.model_dump(include={"type", "id", "name", "input"})]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}],
        },
    ]
    m = client.messages.create(
        model=MODEL, max_tokens=8, messages=turn, tools=[TOOL], tool_choice={"type": "none"}
    )
    assert m.content[0].type == "text" and m.content[0].text


def test_json_output(server: Server) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    m = client_for(server).messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": QUESTION}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    )
    assert set(json.loads(m.content[0].text)) == {"capital"}


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_is_its_own_block(tiny_server: Server, stream: bool) -> None:
    """With a reasoning parser (tiny_server's qwen3), the thinking is a thinking block, signed, before the
    text; the text is forced by a constraint (kiln's structured_outputs), as the random model writes none."""
    client = client_for(tiny_server)
    text = "<think>The user asks for 2+2.</think>It is 4."
    args = {
        "model": "tiny", "max_tokens": 60, "messages": [{"role": "user", "content": "2+2?"}],
        "extra_body": {"temperature": 0, "structured_outputs": {"choice": [text]}},
    }  # fmt: skip
    if stream:
        with client.messages.stream(**args) as s:
            kinds = [e.type for e in s]
            m = s.get_final_message()
        assert "thinking" in kinds and "signature" in kinds and kinds.index("thinking") < kinds.index("text")
    else:
        m = client.messages.create(**args)
    thinking, answer = m.content
    assert (
        thinking.type == "thinking" and thinking.thinking == "The user asks for 2+2." and thinking.signature
    )
    assert answer.type == "text" and answer.text == "It is 4." and m.stop_reason == "end_turn"
    # tiny_server reports prefix-cache hits: Anthropic's input_tokens leave them out.
    assert m.usage.cache_read_input_tokens is not None
    # The thinking, sent back, is the assistant turn's reasoning; thinking off is the template's effort.
    turn = [*args["messages"], {"role": "assistant", "content": [thinking.model_dump(), answer.model_dump()]}]
    turn.append({"role": "user", "content": "And 3+3?"})
    m = client.messages.create(model="tiny", max_tokens=4, messages=turn, thinking={"type": "disabled"})
    assert m.stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_parsed_tool_calls(tiny_server: Server, stream: bool) -> None:
    """tools without tool_choice is tool_choice "auto": the hermes parser reads the text's calls."""
    client = client_for(tiny_server)
    args = {
        "model": "tiny", "max_tokens": 120, "messages": ASK, "tools": [TOOL],
        "extra_body": {"temperature": 0, "structured_outputs": {"choice": [f"Let me check. {CALL}"]}},
    }  # fmt: skip
    if stream:
        with client.messages.stream(**args) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**args)
    text, call = m.content
    assert text.type == "text" and text.text == "Let me check. "
    assert call.type == "tool_use" and call.input == {"city": "Paris", "unit": "celsius"}
    assert m.stop_reason == "tool_use"


@pytest.mark.parametrize(
    "extra, status, kind, says",
    [
        ({"container": "c1"}, 400, "invalid_request_error", "unsupported field `container`"),
        ({"max_tokens": 0}, 400, "invalid_request_error", "`$.max_tokens`"),
        ({"model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, 400, "invalid_request_error",
         "budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "invalid_request_error",
         "thinking.budget_tokens must be less than max_tokens"),
        ({"tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "tool_choice.name is required"),
        ({"messages": []}, 400, "invalid_request_error", "messages must not be empty"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
         400, "invalid_request_error", "messages[0].content[0]: image blocks are not supported"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         400, "invalid_request_error", "tool_use blocks belong in assistant messages"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         400, "invalid_request_error", "Invalid value 'document' - at `$.messages[0].content[0].type`"),
        ({"tools": [TOOL]}, 400, "invalid_request_error", "tool_choice"),  # "auto" needs a parser
    ],
)  # fmt: skip
def test_errors_have_anthropics_shape(server: Server, extra: dict, status: int, kind: str, says: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **extra}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()
    assert list(error) == ["type", "error"] and error["type"] == "error"
    assert set(error["error"]) == {"type", "message"} and error["error"]["type"] == kind
    assert says in error["error"]["message"]


def test_keys_in_either_header(server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    for headers in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        assert (
            httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
        )
    r = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # Elsewhere, keys go as vLLM takes them: Bearer only.
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"x-api-key": API_KEY})
    assert r.status_code == 401


def test_blocks_become_chat_messages() -> None:
    """The conversion, exactly: system blocks joined, tool results as tool messages before the user's
    text, an assistant's thinking as its reasoning and its tool_use as calls, redacted thinking left out,
    an inline system message in place (or merged first, for templates that want it so)."""
    body = {
        "model": "m", "max_tokens": 2000,
        "system": [{"type": "text", "text": "A. "}, {"type": "text", "text": "B."}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call it.", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "system", "content": "Reminder."},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "Sunny"}],
                 "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Thanks"}]},
        ],
        "tools": [{"name": "get_weather", "input_schema": {"properties": {}}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "stop_sequences": ["END"],
        "metadata": {"user_id": "u1"}, "output_config": {"effort": "high"},
    }  # fmt: skip
    request = msgspec.convert(body, MessagesRequest)
    chat = to_chat(request, TemplateTraits(system_first=False, disabled_effort="none"))
    messages = [msgspec.structs.asdict(m) for m in chat.messages]
    shown = [{k: v for k, v in m.items() if v is not None} for m in messages]
    call = msgspec.to_builtins(chat.messages[2].tool_calls)
    assert shown[:2] == [
        {"role": "system", "content": "A. B."},
        {"role": "user", "content": "Weather?"},
    ]
    assert shown[2]["reasoning"] == "Call it." and "content" not in shown[2]
    assert call == [
        {
            "id": "t1",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            "type": "function",
        }
    ]
    assert shown[3:] == [
        {"role": "system", "content": "Reminder."},
        {"role": "tool", "content": "Sunny", "tool_call_id": "t1"},
        {"role": "user", "content": "Thanks"},
    ]
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.reasoning_effort) == ("required", False, "high")
    assert chat.thinking_token_budget == 1024
    assert chat.tools is not None and chat.tools[0].function.parameters == {
        "type": "object",
        "properties": {},
    }
    assert (chat.max_tokens, chat.stop, chat.user) == (2000, ["END"], "u1")
    off = msgspec.structs.replace(request, thinking=msgspec.convert({"type": "disabled"}, ThinkingConfig))
    merged = to_chat(off, TemplateTraits(system_first=True, disabled_effort="low"))
    assert merged.messages[0].content == "A. B.Reminder." and [m.role for m in merged.messages][1:] == [
        "user", "assistant", "tool", "user",
    ]  # fmt: skip
    assert merged.reasoning_effort == "low"


def test_template_traits(default_model_dir: Path) -> None:
    """vLLM's probes: a template that refuses a system message after the first wants them merged; thinking
    off is "none" where the template renders it apart from every effort, else "low"."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    server = ServerConfig()
    assert template_traits(tokenizer, server) == TemplateTraits(system_first=False, disabled_effort="low")
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    assert template_traits(tokenizer, server) == TemplateTraits(system_first=True, disabled_effort="none")
    pinned = ServerConfig(anthropic_disabled_thinking_effort="medium")
    assert template_traits(tokenizer, pinned).disabled_effort == "medium"


def kind(block: msgspec.Struct) -> str:
    return block.__struct_config__.tag  # type: ignore[return-value]


def _history(results: list[str]) -> list[dict]:
    """A conversation of one tool use per turn, each with its result and an assistant's thinking."""
    messages: list[dict] = [{"role": "user", "content": "Weather in three cities?"}]
    for i, result in enumerate(results):
        call = {"type": "tool_use", "id": f"t{i}", "name": "get_weather", "input": {"city": f"City {i}"}}
        thought = {"type": "thinking", "thinking": f"Check city {i}.", "signature": "s"}
        messages.append({"role": "assistant", "content": [thought, call]})
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": result}]}
        )
    return messages


def test_context_edits_clear_as_asked() -> None:
    """The edits on the conversation itself (a stand-in count: the body's JSON length): tool results and
    inputs cleared but for the last `keep` and the excluded tools, once the trigger is passed; none where
    fewer than clear_at_least tokens would go; thinking of all but the last turn."""
    from kiln.api.context_edits import CLEARED, apply_edits

    async def count(b: MessagesRequest) -> int:
        return len(msgspec.json.encode(b.messages))

    def request(edits: list[dict], thinking: str | None = "adaptive") -> MessagesRequest:
        history = _history(["Sunny " * 20, "Rain " * 20, "Snow"])
        body = {"model": "m", "max_tokens": 9, "messages": history, "context_management": {"edits": edits},
                "thinking": thinking and {"type": thinking}}  # fmt: skip
        return msgspec.convert(body, MessagesRequest)

    def shown(b: MessagesRequest) -> list:
        return [(blk.content if kind(blk) == "tool_result" else blk.input) for m in b.messages[1:]
                for blk in m.content if kind(blk) in ("tool_result", "tool_use")]  # fmt: skip

    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
            "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": ["get_weather"]}  # fmt: skip
    body, applied, before, after = asyncio.run(apply_edits(request([edit]), count))
    assert shown(body) == [{}, CLEARED, {}, CLEARED, {"city": "City 2"}, "Snow"]
    assert applied == [ClearedToolUses(2, before - after)] and after < before
    for quiet in ({"trigger": {"type": "tool_uses", "value": 3}}, {"exclude_tools": ["get_weather"]},
                  {"clear_at_least": {"type": "input_tokens", "value": 10_000}}):  # fmt: skip
        body, applied, before, after = asyncio.run(apply_edits(request([{**edit, **quiet}]), count))
        assert applied == [] and before == after and shown(body)[1] == "Sunny " * 20
    thinking = {"type": "clear_thinking_20251015"}  # keep: the last turn's
    body, applied, _, _ = asyncio.run(apply_edits(request([thinking]), count))
    assert [[kind(blk) for blk in m.content] for m in body.messages[1::2]] == [
        ["tool_use"], ["tool_use"], ["thinking", "tool_use"],
    ]  # fmt: skip
    assert applied[0].cleared_thinking_turns == 2
    for keep in ("all", {"type": "all"}):
        assert asyncio.run(apply_edits(request([{**thinking, "keep": keep}]), count))[1] == []
    with pytest.raises(APIError, match="requires `thinking` to be enabled or adaptive"):
        asyncio.run(apply_edits(request([thinking], None), count))


@pytest.mark.parametrize("stream", [False, True])
def test_context_edits_on_the_wire(server: Server, stream: bool) -> None:
    """count_tokens counts the edited prompt (the same as the history sent already edited) beside the
    original; a reply says what its edits cleared, whole and in message_delta."""
    history = _history(["Sunny and warm all day. " * 8, "Rain. " * 8, "Snow."])
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 10},
            "keep": {"type": "tool_uses", "value": 2}}  # fmt: skip
    body = {"model": MODEL, "messages": history, "context_management": {"edits": [edit]}}
    count = post(server, "/v1/messages/count_tokens", json=body).json()
    by_hand = list(history)
    by_hand[2] = {
        "role": "user",
        "content": [{**history[2]["content"][0], "content": "[tool result cleared]"}],
    }
    plain = post(server, "/v1/messages/count_tokens", json={"model": MODEL, "messages": by_hand}).json()
    assert (
        count["input_tokens"] == plain["input_tokens"] < count["context_management"]["original_input_tokens"]
    )
    cleared = count["context_management"]["original_input_tokens"] - count["input_tokens"]
    reply = {**body, "max_tokens": 2, "temperature": 0, "stream": stream}
    r = post(server, "/v1/messages", json=reply)
    if stream:
        events = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in r.text.split("\n\n") if f]
        edits = next(e for e in events if e["type"] == "message_delta")["context_management"]
    else:
        edits = r.json()["context_management"]
    assert edits == {"applied_edits": [
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 1, "cleared_input_tokens": cleared}
    ]}  # fmt: skip
