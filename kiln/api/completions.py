"""POST /v1/completions: prompts in, text (and logprobs) out, whole or as SSE chunks."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kiln.api.errors import APIError
from kiln.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kiln.api.serving import final_outputs, merged, sampling_params, sse, start_all, usage
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.outputs import CompletionOutput, RequestOutput
from kiln.engine.request import PositionLogprobs


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    if prompt and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        return list(prompt)
    raise APIError(
        400,
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        "prompt",
    )


async def create_completion(
    engine: AsyncEngine, request: Request, body: CompletionRequest
) -> CompletionResponse | Response | None:
    model = engine.model_name
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n: kiln does not rank samples", "best_of")
    prompts = prompt_list(body.prompt)
    ids = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    texts = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts]
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    params = [
        sampling_params(body, len(i), engine.max_model_len, body.max_tokens, body.logprobs, echo_logprobs)
        for i in ids
    ]
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = start_all(engine, rid, ids, params)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse(_chunks(merged(streams), rid, model, body, texts, include_usage, engine.tokenizer))
    outputs = await final_outputs(request, streams)
    if outputs is None:
        return None
    choices = [
        _choice(
            i * body.n + c.index, out, c, texts[i] if body.echo else None, body.logprobs, engine.tokenizer
        )
        for i, out in enumerate(outputs)
        for c in out.outputs
    ]
    return CompletionResponse(id=rid, model=model, choices=choices, usage=usage(outputs))


def _choice(
    index: int, out: RequestOutput, c: CompletionOutput, echo: str | None, k: int | None, tokenizer: Any
) -> CompletionChoice:
    text = c.text if echo is None else echo + c.text
    logprobs = None
    if k is not None:
        positions: list[PositionLogprobs | None] = []
        ids: list[int] = []
        if echo is not None:
            positions += out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            ids += out.prompt_token_ids
        positions += c.logprobs or []
        ids += c.token_ids
        logprobs = completion_logprobs(ids, positions, k, 0, tokenizer)
    return CompletionChoice(index, text, logprobs, c.finish_reason, c.stop_reason)


def completion_logprobs(
    ids: list[int], positions: list[PositionLogprobs | None], k: int, offset: int, tokenizer: Any
) -> CompletionLogprobs:
    """The legacy format: the chosen tokens' logprobs and, per position, the top k (plus the chosen)."""
    out = CompletionLogprobs()
    for token, entry in zip(ids, positions, strict=True):
        out.text_offset.append(offset)
        if entry is None:  # the first prompt token has nothing to condition on
            word = tokenizer.decode([token])
            out.tokens.append(word)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            offset += len(word)
            continue
        chosen = entry[token]
        out.tokens.append(chosen.decoded_token)
        out.token_logprobs.append(chosen.logprob)
        out.top_logprobs.append(
            {lp.decoded_token: lp.logprob for lp in entry.values() if lp.rank <= k or lp is chosen}
        )
        offset += len(chosen.decoded_token)
    return out


async def _chunks(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    rid: str,
    model: str,
    body: CompletionRequest,
    texts: list[str],
    include_usage: bool,
    tokenizer: Any,
) -> AsyncIterator[CompletionResponse]:
    sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) already sent
    finals: dict[int, RequestOutput] = {}
    async for i, out in outputs:
        choices = []
        for c in out.outputs:
            index = i * body.n + c.index
            chars, tokens = sent.get(index, (0, 0))
            first = index not in sent
            if not first and len(c.text) == chars and len(c.token_ids) == tokens and not c.finished:
                continue
            text = c.text[chars:]
            if first and body.echo:
                text = texts[i] + text
            logprobs = None
            if body.logprobs is not None:
                ids, entries = c.token_ids[tokens:], (c.logprobs or [])[tokens:]
                offset = chars + (len(texts[i]) if body.echo else 0)
                if first and body.echo:
                    ids = out.prompt_token_ids + ids
                    entries = (out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
                    offset = 0
                logprobs = completion_logprobs(ids, entries, body.logprobs, offset, tokenizer)
            sent[index] = (len(c.text), len(c.token_ids))
            choices.append(CompletionChoice(index, text, logprobs, c.finish_reason, c.stop_reason))
        if out.finished:
            finals[i] = out
        if choices:
            yield CompletionResponse(id=rid, model=model, choices=choices)
    if include_usage:
        yield CompletionResponse(id=rid, model=model, choices=[], usage=usage(list(finals.values())))
