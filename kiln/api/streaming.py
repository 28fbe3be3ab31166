"""What both endpoints stream (server-sent events of their chunks, ending in `data: [DONE]`), and the
usage both report, streamed or whole."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET
from starlette.responses import StreamingResponse

from kiln.api.errors import as_api_error
from kiln.api.protocol import _SamplingRequest
from kiln.api.responses import PromptTokensDetails, Usage
from kiln.engine.request_output import CompletionOutput, RequestOutput, merge

_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class ChoiceDelta:
    index: int  # the choice's index in the response: prompt * n + sequence
    prompt: int  # which of the request's prompts
    first: bool  # the choice's first delta
    offset: int  # characters of the choice's text sent before this delta
    output: CompletionOutput  # what is new
    request: RequestOutput


@dataclass(slots=True, frozen=True)
class UsageAsked:
    """Where a stream carries its usage (stream_options, as vLLM reads them), and what it holds."""

    final: bool  # a chunk without choices at the end
    continuous: bool  # vLLM's continuous_usage_stats: every chunk too, the usage so far
    cached: bool  # prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details)


def usage_asked(body: _SamplingRequest, cached: bool) -> UsageAsked:
    opts = body.stream_options
    final = opts is not None and opts.include_usage
    return UsageAsked(final, final and opts is not None and opts.continuous_usage_stats, cached)


def stream_interval(body: _SamplingRequest, server: int) -> int:
    """vLLM's: the request may raise the server's --stream-interval, not lower it."""
    return max(server, body.stream_interval or 1)


def every(
    outputs: AsyncIterator[tuple[int, RequestOutput]], interval: int
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """vLLM's stream_interval: each prompt's outputs merged until they hold `interval` tokens; its first
    and a finishing one go at once."""
    return outputs if interval == 1 else _every(outputs, interval)


async def _every(
    outputs: AsyncIterator[tuple[int, RequestOutput]], interval: int
) -> AsyncIterator[tuple[int, RequestOutput]]:
    held: dict[int, list[RequestOutput]] = {}
    tokens: dict[int, int] = {}
    async with contextlib.aclosing(outputs):  # leaving early aborts what is unfinished, through merged()
        async for i, out in outputs:
            first = i not in held
            waiting = held.setdefault(i, [])
            waiting.append(out)
            tokens[i] = tokens.get(i, 0) + sum(len(c.token_ids) for c in out.outputs)
            if first or tokens[i] >= interval or out.finished or any(c.finished for c in out.outputs):
                yield i, merge(waiting)
                waiting.clear()
                tokens[i] = 0


def stream_response(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    chunks: Callable[[list[ChoiceDelta]], list[Any]],
    usage_chunk: Callable[..., msgspec.Struct],
    asked: UsageAsked,
    keep_alive: int,
) -> StreamingResponse:
    """What both endpoints stream: their chunks (`events`) as server-sent events."""
    return sse(events(outputs, n, chunks, usage_chunk, asked), keep_alive)


async def events(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    chunks: Callable[[list[ChoiceDelta]], list[Any]],
    usage_chunk: Callable[..., msgspec.Struct],
    asked: UsageAsked,
) -> AsyncIterator[Any]:
    """Each engine output (from `merged`) as the endpoint's chunks of choice deltas; then, if asked, one
    chunk without choices (usage_chunk: the endpoint's chunk type) with the usage."""
    sent: dict[int, int] = {}  # choice index -> characters sent
    prompts: dict[int, RequestOutput] = {}  # each prompt's latest output
    completion_tokens = 0
    async for i, out in outputs:
        deltas = []
        for c in out.outputs:
            index = i * n + c.index
            deltas.append(ChoiceDelta(index, i, index not in sent, sent.get(index, 0), c, out))
            sent[index] = sent.get(index, 0) + len(c.text)
            completion_tokens += len(c.token_ids)
        prompts[i] = out
        so_far = _usage(prompts.values(), completion_tokens, asked.cached) if asked.continuous else None
        for chunk in chunks(deltas):
            if so_far is not None:
                chunk.usage = so_far
            yield chunk
    if asked.final:
        yield usage_chunk(choices=[], usage=_usage(prompts.values(), completion_tokens, asked.cached))


def _usage(prompts: Iterable[RequestOutput], completion: int, cached: bool) -> Usage:
    """The usage of these prompts' outputs (one each) with `completion` tokens generated."""
    prompt, hits = 0, 0
    for out in prompts:
        prompt += len(out.prompt_token_ids)
        hits += out.num_cached_tokens
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(hits) if cached else UNSET)


def usage(outputs: list[RequestOutput], cached: bool) -> Usage:
    return _usage(outputs, sum(len(c.token_ids) for o in outputs for c in o.outputs), cached)


KEEP_ALIVE = b": keep-alive\n\n"


def sse(events: AsyncIterator[msgspec.Struct], keep_alive: int = 0, named: bool = False) -> StreamingResponse:
    """Server-sent events ending in `data: [DONE]`; an error mid-stream becomes an error event first.
    keep_alive: seconds without an event after which a comment goes (0: none). named: Anthropic's form,
    each event's type (its Struct's tag) on an `event:` line too, an error as its error event, no [DONE]."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                name = b"event: %s\n" % type(event).__struct_config__.tag.encode() if named else b""
                yield name + b"data: " + _encoder.encode(event) + b"\n\n"
        except Exception as e:
            error = as_api_error(e)
            if named:
                yield b"event: error\ndata: " + _encoder.encode(error.anthropic_body()) + b"\n\n"
                return
            yield b"data: " + _encoder.encode(error.body()) + b"\n\n"
        if not named:
            yield b"data: [DONE]\n\n"

    chunks = body() if keep_alive == 0 else _kept_alive(body(), keep_alive)
    return StreamingResponse(chunks, media_type="text/event-stream")


async def _kept_alive(chunks: AsyncIterator[bytes], interval: float) -> AsyncIterator[bytes]:
    """vLLM's --sse-keep-alive-interval: KEEP_ALIVE after every `interval` seconds without a chunk, so
    a proxy with a read timeout keeps a queued or slow stream open."""
    pending = asyncio.ensure_future(anext(chunks))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            yield chunk
            pending = asyncio.ensure_future(anext(chunks))
    finally:
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await chunks.aclose()  # type: ignore[attr-defined]
