"""A chat reply as the Messages API's: whole, as content blocks (thinking, text, tool_use), or streamed, as
Anthropic's events in its order (message_start; each content block started, its deltas, stopped;
message_delta with the stop reason and usage; message_stop)."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from kiln.api.messages_protocol import (
    AppliedEdits,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ContentOut,
    InputJsonDelta,
    MessageDelta,
    MessagesResponse,
    MessageStart,
    MessageStop,
    SignatureDelta,
    StopDelta,
    StopReason,
    StreamEvent,
    TextDelta,
    TextOut,
    ThinkingDelta,
    ThinkingOut,
    ToolUseOut,
    Usage,
)
from kiln.api.responses import ChatCompletionChunk, ChatCompletionResponse
from kiln.api.responses import Usage as ChatUsage


def whole(
    reply: ChatCompletionResponse, rid: str, model: str, edits: AppliedEdits | UnsetType = UNSET
) -> MessagesResponse:
    """edits: the request's context edits, where it asked for some."""
    choice = reply.choices[0]
    message = choice.message
    content: list[ContentOut] = []
    if isinstance(message.reasoning, str) and message.reasoning:
        content.append(ThinkingOut(message.reasoning, uuid.uuid4().hex))
    if message.content:
        content.append(TextOut(message.content))
    for call in message.tool_calls:
        args = _object(call.function.arguments)
        # Arguments cut short (max_tokens) are no object: they stay text, as the model wrote them.
        content.append(
            ToolUseOut(call.id, call.function.name, args)
            if args is not None
            else TextOut(call.function.arguments)
        )
    called = any(isinstance(c, ToolUseOut) for c in content)
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, called, called)
    # Anthropic's empty reply is one empty text block, which strict clients expect at content[0].
    return MessagesResponse(
        id=rid,
        model=model,
        content=content or [TextOut("")],
        stop_reason=reason,
        stop_sequence=sequence,
        usage=usage(reply.usage),
        context_management=edits,
    )


def _object(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def usage(u: ChatUsage) -> Usage:
    """Anthropic's input_tokens leave out those read from the cache, reported apart (where they are)."""
    details = u.prompt_tokens_details
    if isinstance(details, msgspec.UnsetType):
        return Usage(u.prompt_tokens, u.completion_tokens)
    hits = details.cached_tokens
    return Usage(u.prompt_tokens - hits, u.completion_tokens, hits)


def stop_reason(
    finish: str | None, stop: int | str | None, called: bool, complete: bool
) -> tuple[StopReason | None, str | None]:
    """vLLM's mapping: max_tokens wins; then tool_use where the calls are whole; a stop string matched is
    stop_sequence (a stop token is not); then tool_use for calls cut short by it, else end_turn."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish == "tool_calls" or called:
        return "tool_use", None
    return "end_turn", None


async def events(
    chunks: AsyncIterator[ChatCompletionChunk], rid: str, model: str, edits: AppliedEdits | UnsetType = UNSET
) -> AsyncIterator[StreamEvent]:
    blocks = _Blocks()
    finish: str | None = None
    stop: int | str | None = None
    final: ChatUsage | None = None
    started = False
    async with contextlib.aclosing(chunks):  # leaving early aborts the request
        async for chunk in chunks:
            if not started:
                assert chunk.usage is not None, "the chat request asked for every chunk's usage"
                start = MessagesResponse(
                    id=rid,
                    model=model,
                    content=[],
                    stop_reason=None,
                    stop_sequence=None,
                    usage=usage(chunk.usage),
                )
                yield MessageStart(start)
                started = True
            if not chunk.choices:
                final = chunk.usage
                continue
            c = chunk.choices[0]
            d = c.delta
            if d.reasoning:
                for e in blocks.add("thinking", d.reasoning):
                    yield e
            if d.content:
                for e in blocks.add("text", d.content):
                    yield e
            for call in d.tool_calls or []:
                if call.id is not None and call.function.name is not None:
                    for e in blocks.open(ToolUseOut(call.id, call.function.name, {})):
                        yield e
                if call.function.arguments:
                    yield blocks.arguments(call.function.arguments)
            if c.finish_reason is not None:
                finish, stop = c.finish_reason, c.stop_reason
    for e in blocks.close():
        yield e
    assert final is not None, "the chat request asked for its usage"
    # Only the last call can be cut short (by max_tokens or a stop string).
    reason, sequence = stop_reason(
        finish, stop, blocks.called, blocks.called and _object(blocks.args) is not None
    )
    yield MessageDelta(StopDelta(reason, sequence), usage(final), edits)
    yield MessageStop()


class _Blocks:
    """The open content block, and the index of the next."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.called = False
        self.args = ""  # the last call's arguments so far

    def open(self, block: TextOut | ThinkingOut | ToolUseOut) -> list[StreamEvent]:
        out = self.close()
        self.index += 1
        self.kind = type(block).__struct_config__.tag  # type: ignore[assignment]
        if isinstance(block, ToolUseOut):
            self.called, self.args = True, ""
        out.append(ContentBlockStart(self.index, block))
        return out

    def add(self, kind: str, text: str) -> list[StreamEvent]:
        """Text or thinking, in the open block of that kind, or a new one."""
        out = [] if kind == self.kind else self.open(TextOut("") if kind == "text" else ThinkingOut(""))
        delta = TextDelta(text) if kind == "text" else ThinkingDelta(text)
        out.append(ContentBlockDelta(self.index, delta))
        return out

    def arguments(self, text: str) -> StreamEvent:
        """More of the open call's arguments: a chat stream sends a call's pieces in a row."""
        assert self.kind == "tool_use", "a tool call's arguments came before its name"
        self.args += text
        return ContentBlockDelta(self.index, InputJsonDelta(text))

    def close(self) -> list[StreamEvent]:
        if self.kind is None:
            return []
        out: list[StreamEvent] = []
        if self.kind == "thinking":  # a thinking block ends with its signature
            out.append(ContentBlockDelta(self.index, SignatureDelta(uuid.uuid4().hex)))
        out.append(ContentBlockStop(self.index))
        self.kind = None
        return out
