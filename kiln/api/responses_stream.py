"""The Responses API's stream: a chat reply's chunks as OpenAI's events, in its order (the response
created, each output item opened, its text or arguments in deltas, closed; the response completed)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from kiln.api.inputs import Inputs
from kiln.api.responses import ChatCompletionChunk, TokenLogprob, Usage
from kiln.api.responses_protocol import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponsesRequest,
    item_id,
    response_body,
    response_usage,
)


async def reasoning_tokens(inputs: Inputs, reasoning: str) -> int:
    """The reasoning's length in tokens, counted again from its text (the usage's reasoning_tokens)."""
    return len(await inputs.tokenize(reasoning, False)) if reasoning else 0


async def events(
    body: ResponsesRequest,
    rid: str,
    model: str,
    chunks: AsyncIterator[ChatCompletionChunk],
    inputs: Inputs,
) -> AsyncIterator[dict[str, Any]]:
    """The chat chunks as the Responses API's events: the response created, then each output item opened,
    its text (or arguments) in deltas, and closed, then the response completed (or incomplete)."""
    stream = _ItemStream(bool(body.include))
    yield stream.event("response.created", response=response_body(body, rid, model, None, [], None))
    yield stream.event("response.in_progress", response=response_body(body, rid, model, None, [], None))
    finish: str | None = None
    usage: Usage | None = None
    async with contextlib.aclosing(chunks):  # leaving early aborts the request
        async for chunk in chunks:
            if not chunk.choices:
                usage = chunk.usage
                continue
            for c in chunk.choices:
                d = c.delta
                if d.reasoning:
                    for e in stream.text("reasoning", d.reasoning, None):
                        yield e
                if d.content:
                    logprobs = c.logprobs.content if c.logprobs is not None else []
                    for e in stream.text("message", d.content, logprobs):
                        yield e
                for call in d.tool_calls or []:
                    for e in stream.call(
                        call.index, call.id, call.function.name, call.function.arguments or ""
                    ):
                        yield e
                finish = c.finish_reason or finish
    for e in stream.close():
        yield e
    assert usage is not None, "the chat request asked for its usage"
    result = response_body(
        body,
        rid,
        model,
        finish or "stop",
        stream.items,
        response_usage(usage, await reasoning_tokens(inputs, stream.reasoning)),
    )
    yield stream.event(f"response.{result.status}", response=result)


class _ItemStream:
    """The output items of a streamed response: the one open (reasoning, message or function call) takes
    the deltas of its kind; a delta of another kind closes it and opens the next."""

    def __init__(self, logprobs: bool) -> None:
        self.logprobs = logprobs
        self.sequence = itertools.count()
        self.items: list[OutputItem] = []  # closed
        self.kind: str | tuple[str, int] | None = None  # the open item's: "reasoning", "message", ("call", i)
        self.item_id = ""
        self.parts: list[str] = []
        self.token_logprobs: list[TokenLogprob] = []
        self.open_call: FunctionCallItem | None = None
        self.reasoning = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(self.sequence), **fields}

    @property
    def index(self) -> int:  # the open item's output_index
        return len(self.items)

    def text(self, kind: str, delta: str, logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
        out = []
        if self.kind != kind:
            out += self.close()
            prefix = "rs" if kind == "reasoning" else "msg"
            self.kind, self.item_id, self.parts, self.token_logprobs = kind, item_id(prefix), [], []
            if kind == "reasoning":
                item: OutputItem = ReasoningItem(self.item_id, [], status="in_progress")
                part: OutputText | ReasoningText = ReasoningText("")
            else:
                item = MessageItem(self.item_id, [], status="in_progress")
                part = OutputText("", logprobs=[] if self.logprobs else msgspec.UNSET)
            out.append(self.event("response.output_item.added", output_index=self.index, item=item))
            out.append(self._part("response.content_part.added", part))
        self.parts.append(delta)
        where = {"item_id": self.item_id, "output_index": self.index, "content_index": 0}
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **where, delta=delta))
        else:
            self.token_logprobs += logprobs or []
            out.append(
                self.event("response.output_text.delta", **where, delta=delta, logprobs=logprobs or [])
            )
        return out

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[dict[str, Any]]:
        out = []
        if self.kind != ("call", index):
            out += self.close()
            self.kind, self.item_id = ("call", index), item_id("fc")
            self.open_call = FunctionCallItem(
                self.item_id, call_id or "", name or "", "", status="in_progress"
            )
            out.append(self.event("response.output_item.added", output_index=self.index, item=self.open_call))
        assert self.open_call is not None
        if arguments:
            self.open_call.arguments += arguments
            where = {"item_id": self.item_id, "output_index": self.index}
            out.append(self.event("response.function_call_arguments.delta", **where, delta=arguments))
        return out

    def close(self) -> list[dict[str, Any]]:
        """The open item's closing events; it joins the response's output."""
        out: list[dict[str, Any]] = []
        where = {"item_id": self.item_id, "output_index": self.index}
        if self.kind in ("reasoning", "message"):
            text = "".join(self.parts)
            if self.kind == "reasoning":
                self.reasoning += text
                part: OutputText | ReasoningText = ReasoningText(text)
                item: OutputItem = ReasoningItem(self.item_id, [part])
                out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            else:
                part = OutputText(text, logprobs=self.token_logprobs if self.logprobs else msgspec.UNSET)
                item = MessageItem(self.item_id, [part])
                logprobs = self.token_logprobs
                out.append(
                    self.event(
                        "response.output_text.done", **where, content_index=0, text=text, logprobs=logprobs
                    )
                )
            out.append(self._part("response.content_part.done", part))
        elif self.open_call is not None:
            call = self.open_call
            item = FunctionCallItem(self.item_id, call.call_id, call.name, call.arguments)
            args = {"arguments": item.arguments, "name": item.name}
            out.append(self.event("response.function_call_arguments.done", **where, **args))
            self.open_call = None
        else:
            return out
        out.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.items.append(item)
        self.kind = None
        return out

    def _part(self, kind: str, part: OutputText | ReasoningText) -> dict[str, Any]:
        return self.event(kind, item_id=self.item_id, output_index=self.index, content_index=0, part=part)
