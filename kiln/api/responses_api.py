"""POST /v1/responses, OpenAI's Responses API, over the chat path: the request becomes a chat request
(instructions and input items as messages, text.format as response_format, function tools as chat tools)
and the chat reply becomes output items: the reasoning (with a reasoning parser), the message, the
function calls. Streamed, the chat chunks become the Responses API's events, in OpenAI's order."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kiln.api.chat import chat
from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.protocol import ChatCompletionRequest
from kiln.api.responses import ChatCompletionResponse
from kiln.api.responses_protocol import (
    FunctionCallItem,
    FunctionTool,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseBody,
    ResponsesRequest,
    TextConfig,
    item_id,
    response_body,
    response_usage,
)
from kiln.api.responses_stream import events, reasoning_tokens
from kiln.api.serving import generating, response_id
from kiln.api.streaming import sse
from kiln.engine.async_engine import AsyncEngine

# Fields that go to the chat request as they are.
_SAME = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output", "structured_outputs", "chat_template_kwargs", "include_reasoning",
    "thinking_token_budget", "priority", "cache_salt", "request_id", "user", "metadata", "session_id",
    "parallel_tool_calls",
)  # fmt: skip


async def create_response(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: ResponsesRequest
) -> ResponseBody | Response | None:
    generating(engine, "Responses")
    rid = response_id("resp_", request, body.request_id)
    reply = await chat(engine, inputs, request, to_chat(body), cached=True)
    if reply is None:
        return None
    if isinstance(reply, ChatCompletionResponse):
        return await _whole(body, rid, engine.served_name(body.model), reply, inputs)
    return sse(events(body, rid, engine.served_name(body.model), reply, inputs))


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The same request on the chat path; what it cannot carry is a 400 naming the field."""
    if body.previous_response_id is not None:
        raise APIError(
            404,
            f"Response with id {body.previous_response_id!r} not found: kiln stores no responses, so send "
            "the conversation as `input`",
            "previous_response_id",
        )
    if body.background:
        raise APIError(400, "background responses are not supported: kiln stores no responses", "background")
    if body.truncation != "disabled":
        raise APIError(400, 'truncation "auto" is not supported; use truncate_prompt_tokens', "truncation")
    if body.reasoning is not None and body.reasoning.summary is not None:
        raise APIError(400, "reasoning summaries are not supported", "reasoning")
    logprobs = bool(body.include)
    if body.top_logprobs and not logprobs:
        raise APIError(400, 'top_logprobs needs include ["message.output_text.logprobs"]', "top_logprobs")
    fields: dict[str, Any] = {name: getattr(body, name) for name in _SAME}
    fields |= {
        "messages": _messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None,
        "logprobs": logprobs,
        "top_logprobs": body.top_logprobs if logprobs else None,
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        "response_format": _response_format(body.text),
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": _function(t)} for t in body.tools]
        choice = body.tool_choice
        fields["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    return msgspec.convert({k: v for k, v in fields.items() if v is not None}, ChatCompletionRequest)


def _function(tool: FunctionTool) -> dict[str, Any]:
    """A Responses function tool (flat) as chat's `function`."""
    fields = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {k: v for k, v in fields.items() if v is not None} | {"strict": tool.strict}


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """instructions as a system message, then the input's items as chat messages. A reasoning item's text
    goes with the assistant turn that follows it (the chat message's `reasoning`, which templates such as
    Qwen3's show again within a turn of tool calls)."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    thought: str | None = None
    for i, item in enumerate(body.input):
        try:
            if item.get("type") == "reasoning":
                thought = "".join(part["text"] for part in item.get("content") or ())
                continue
            message = _message(item)
        except (KeyError, TypeError, ValueError) as e:
            raise APIError(400, f"input[{i}]: {e}", "input") from None
        if message["role"] == "assistant" and thought:
            message["reasoning"] = thought
        thought = None
        last = messages[-1] if messages else None
        if message.get("tool_calls") and last is not None and last.get("tool_calls"):
            last["tool_calls"] += message["tool_calls"]  # consecutive calls: one assistant turn
        else:
            messages.append(message)
    return messages


def _message(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "message":
        content = item["content"]
        if not isinstance(content, str):
            kinds = {part.get("type") for part in content} - {"input_text", "output_text", "text"}
            if kinds:
                raise ValueError(f"only text content parts are supported, not {sorted(map(str, kinds))}")
            content = "".join(part["text"] for part in content)
        return {"role": item["role"], "content": content}
    if kind == "function_call":
        call = {"id": item["call_id"], "function": {"name": item["name"], "arguments": item["arguments"]}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    raise ValueError(f"items of type {kind!r} are not supported")


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None:
        raise APIError(400, "text.format of type json_schema needs its name", "text")
    schema = {"name": fmt.name, "schema": fmt.schema, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


async def _whole(
    body: ResponsesRequest, rid: str, model: str, reply: ChatCompletionResponse, inputs: Inputs
) -> ResponseBody:
    choice = reply.choices[0]
    message = choice.message
    items: list[OutputItem] = []
    reasoning = message.reasoning if isinstance(message.reasoning, str) else ""
    if reasoning:
        items.append(ReasoningItem(item_id("rs"), [ReasoningText(reasoning)]))
    if message.content:
        logprobs = choice.logprobs.content if choice.logprobs is not None else msgspec.UNSET
        items.append(MessageItem(item_id("msg"), [OutputText(message.content, logprobs=logprobs)]))
    for call in message.tool_calls:
        items.append(FunctionCallItem(item_id("fc"), call.id, call.function.name, call.function.arguments))
    usage = response_usage(reply.usage, await reasoning_tokens(inputs, reasoning))
    return response_body(body, rid, model, choice.finish_reason, items, usage)
