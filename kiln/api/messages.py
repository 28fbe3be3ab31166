"""POST /v1/messages and /v1/messages/count_tokens, Anthropic's Messages API, over the chat path as vLLM
serves it: the request becomes a chat request (system and content blocks as messages, tools and
tool_choice as chat's, thinking as thinking_token_budget or reasoning_effort, output_config.format as a
JSON schema), and the chat reply becomes content blocks (thinking, text, tool_use), whole or as
Anthropic's stream events (kiln.api.messages_stream)."""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType
from starlette.requests import Request
from starlette.responses import Response

from kiln.api.chat import chat, shown_tools
from kiln.api.context_edits import apply_edits
from kiln.api.defaults import with_defaults
from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.messages_protocol import (
    AppliedEdits,
    CountTokensRequest,
    CountTokensResponse,
    ImageBlock,
    Message,
    MessagesRequest,
    MessagesResponse,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolDefinition,
    ToolResultBlock,
    ToolUseBlock,
)
from kiln.api.messages_reply import events, whole
from kiln.api.protocol import ChatCompletionRequest
from kiln.api.responses import ChatCompletionResponse
from kiln.api.serving import generating, response_id
from kiln.api.streaming import sse
from kiln.api.template_traits import TemplateTraits
from kiln.engine.async_engine import AsyncEngine

# Claude Code's first system block: a hash that changes every request, which would defeat the prefix cache
# (vLLM leaves it out too).
BILLING_HEADER = "x-anthropic-billing-header"


async def create_message(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: MessagesRequest
) -> MessagesResponse | Response | None:
    generating(engine, "Messages")
    rid = response_id("msg_", request, None)
    model = engine.served_name(body.model)
    traits = inputs.template_traits()
    edits: AppliedEdits | UnsetType = UNSET
    if body.context_management is not None:
        body, applied, _, _ = await apply_edits(body, functools.partial(_count, inputs, traits))
        edits = AppliedEdits(applied)
    reply = await chat(
        engine, inputs, request, _as_chat(body, inputs, traits), inputs.limits.enable_prompt_tokens_details
    )
    if reply is None:
        return None
    if isinstance(reply, ChatCompletionResponse):
        return whole(reply, rid, model, edits)
    return sse(events(reply, rid, model, edits), inputs.limits.sse_keep_alive_interval, named=True)


async def count_tokens(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: CountTokensRequest
) -> CountTokensResponse:
    """The prompt's tokens, as /v1/messages would render it, after its context edits (and before them)."""
    generating(engine, "Messages")
    count = functools.partial(_count, inputs, inputs.template_traits())
    before = after = None
    if body.context_management is not None:
        _, _, before, after = await apply_edits(body, count)
    if after is None:  # no edit counted the prompt
        before = after = await count(body)
    return CountTokensResponse(after, {"original_input_tokens": before or after})


async def _count(inputs: Inputs, traits: TemplateTraits, body: MessagesRequest | CountTokensRequest) -> int:
    as_chat = _as_chat(body, inputs, traits)
    return len(await inputs.chat_ids(as_chat, shown_tools(as_chat, inputs.limits)))


def _as_chat(
    body: MessagesRequest | CountTokensRequest, inputs: Inputs, traits: TemplateTraits
) -> ChatCompletionRequest:
    return with_defaults(to_chat(body, traits), inputs.limits)


# -- the request ------------------------------------------------------------------------------------


def to_chat(body: MessagesRequest | CountTokensRequest, traits: TemplateTraits) -> ChatCompletionRequest:
    """The same request on the chat path; what it cannot carry is a 400 naming the field."""
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body, traits.system_first),
        "chat_template_kwargs": body.chat_template_kwargs,
    }
    thinking, out = body.thinking, body.output_config
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "user": body.metadata.user_id if body.metadata is not None else None,
            "cache_salt": body.cache_salt,
            "structured_outputs": body.structured_outputs,
            "priority": body.priority,
            "stream": body.stream,
            # Every chunk's usage: the first gives message_start its input tokens.
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}
            if body.stream
            else None,
        }
        if thinking is not None and thinking.type == "enabled":
            if thinking.budget_tokens is None:
                raise APIError(
                    400, "thinking.budget_tokens is required when thinking.type is enabled", "thinking"
                )
            if thinking.budget_tokens >= body.max_tokens:
                raise APIError(400, "thinking.budget_tokens must be less than max_tokens", "thinking")
            fields["thinking_token_budget"] = thinking.budget_tokens
    if out is not None and out.format is not None:
        schema = {"name": "json_schema", "schema": out.format.schema}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    # "adaptive" leaves the effort to output_config; "disabled" overrides it.
    fields["reasoning_effort"] = out.effort if out is not None else None
    if thinking is not None and thinking.type == "disabled":
        fields["reasoning_effort"] = traits.disabled_effort
    if body.tools is not None:
        fields["tools"] = [{"type": "function", "function": _function(t)} for t in body.tools]
        fields["tool_choice"] = "auto"
    choice = body.tool_choice
    if choice is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if choice.type == "tool":
            if not choice.name:
                raise APIError(
                    400, "tool_choice.name is required when tool_choice.type is 'tool'", "tool_choice"
                )
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return msgspec.convert({k: v for k, v in fields.items() if v is not None}, ChatCompletionRequest)


def _function(tool: ToolDefinition) -> dict[str, Any]:
    schema = tool.input_schema if "type" in tool.input_schema else {"type": "object", **tool.input_schema}
    fields = {"name": tool.name, "description": tool.description, "parameters": schema, "strict": tool.strict}
    return {k: v for k, v in fields.items() if v is not None}


def _messages(body: MessagesRequest | CountTokensRequest, system_first: bool) -> list[dict[str, Any]]:
    """The system prompt first (with inline system messages, where the template wants them there), then
    each message's blocks as chat messages: a user turn's tool results become tool messages before its
    text; an assistant turn's thinking its `reasoning`, its tool_use blocks its tool calls."""
    system = [body.system] if isinstance(body.system, str) else _texts(body.system or [])
    if system_first:
        system += [t for m in body.messages if m.role == "system" for t in _system_texts(m)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "".join(system)}] if system else []
    for i, m in enumerate(body.messages):
        if m.role == "system":
            text = "".join(_system_texts(m))
            if text and not system_first:
                messages.append({"role": "system", "content": text})
        elif isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        else:
            messages += _turn(m, f"messages[{i}]")
    return messages


def _texts(blocks: list[TextBlock]) -> list[str]:
    return [b.text for b in blocks if b.text and not b.text.startswith(BILLING_HEADER)]


def _system_texts(m: Message) -> list[str]:
    if isinstance(m.content, str):
        return [] if m.content.startswith(BILLING_HEADER) else [m.content]
    return _texts([b for b in m.content if isinstance(b, TextBlock)])


def _turn(m: Message, where: str) -> list[dict[str, Any]]:
    assert not isinstance(m.content, str)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(m.content):
        here = f"{where}.content[{j}]"
        if isinstance(block, TextBlock):
            if block.text:
                texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, RedactedThinkingBlock):
            continue
        elif isinstance(block, ImageBlock):
            raise APIError(
                400, f"{here}: image blocks are not supported (kiln serves text-only models)", "messages"
            )
        elif isinstance(block, ToolUseBlock):
            if m.role != "assistant":
                raise APIError(400, f"{here}: tool_use blocks belong in assistant messages", "messages")
            call = {"name": block.name, "arguments": json.dumps(block.input)}
            calls.append({"id": block.id, "type": "function", "function": call})
        else:
            assert isinstance(block, ToolResultBlock)
            if m.role != "user":
                raise APIError(400, f"{here}: tool_result blocks belong in user messages", "messages")
            results.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": _result(block, here)}
            )
    message: dict[str, Any] = {"role": m.role}
    if texts:
        message["content"] = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning"] = "".join(thoughts)
    # A user turn of tool results only is those results (vLLM's).
    keep = m.role == "assistant" or "content" in message
    return [*results, message] if keep else results


def _result(block: ToolResultBlock, where: str) -> str:
    if not isinstance(block.content, list):
        return block.content or ""
    if any(isinstance(part, ImageBlock) for part in block.content):
        raise APIError(
            400, f"{where}: image blocks are not supported (kiln serves text-only models)", "messages"
        )
    return "\n".join(part.text for part in block.content if isinstance(part, TextBlock))
