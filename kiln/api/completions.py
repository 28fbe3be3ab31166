"""POST /v1/completions: prompts in, text (and logprobs) out, whole or as SSE chunks."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kiln.api.beam_search import beam_search_all, check_beam_search
from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.protocol import CompletionRequest
from kiln.api.request_log import log_outputs, log_requests, logged
from kiln.api.responses import CompletionChoice, CompletionLogprobs, CompletionResponse
from kiln.api.serving import (
    api_logprob,
    constraint,
    final_outputs,
    generating,
    ids_if,
    merged,
    prompt_logprobs,
    request_metrics,
    response_id,
    sampling_params,
    start_all,
    token_text,
    usage_chunk,
)
from kiln.api.streaming import ChoiceDelta, every, stream_interval, stream_response, usage, usage_asked
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.request import PositionLogprobs
from kiln.engine.request_output import CompletionOutput, RequestOutput
from kiln.engine.request_stream import RequestStream


async def create_completion(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: CompletionRequest
) -> CompletionResponse | Response | None:
    generating(engine, "Completions")
    model = engine.served_name(body.model)
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n: kiln does not rank samples", "best_of")
    inputs.check_request(body)
    check_beam_search(body)
    # As vLLM: echo with max_tokens 0 returns the prompt alone (with its logprobs if asked). The engine
    # runs the prefill that scores the prompt and samples one token, which is dropped.
    prompt_only = body.echo and body.max_tokens == 0
    max_tokens = 1 if prompt_only else body.max_tokens
    prompts = await inputs.completion_prompts(body, max_tokens)
    texts = [p.text or "" for p in prompts]
    # The prompt's logprobs serve echo's logprobs and vLLM's prompt_logprobs: the engine scores the more.
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    scored = [k for k in (echo_logprobs, body.prompt_logprobs) if k is not None]
    so = await constraint(engine, inputs, body)
    params = [
        sampling_params(
            body,
            len(p.ids),
            engine.max_model_len,
            max_tokens,
            body.logprobs,
            max(scored, default=None),
            so,
            engine.sampling_defaults,
        )
        for p in prompts
    ]
    rid = response_id("cmpl-", request, body.request_id)
    cached = inputs.limits.enable_prompt_tokens_details
    await log_requests(inputs, rid, [p.engine_prompt for p in prompts], params)
    streams: list[RequestStream] = []  # (beam search's requests are its own: no metrics)
    if body.use_beam_search:
        if body.prompt_embeds is not None:
            raise APIError(400, "use_beam_search is not supported with prompt embeds", "use_beam_search")
        finals = await beam_search_all(engine, request, body, rid, [p.ids for p in prompts], params)
    else:
        streams = start_all(engine, request, body, rid, [p.engine_prompt for p in prompts], params)
        if body.stream:
            last = usage_chunk(CompletionResponse, streams, inputs.limits, id=rid, model=model)
            chunks = functools.partial(_chunks, rid, model, body, texts, engine.tokenizer)
            outputs = logged(inputs.limits, rid, len(prompts), merged(streams))
            outputs = every(outputs, stream_interval(body, inputs.limits.stream_interval))
            outputs = _without_completions(outputs) if prompt_only else outputs
            asked = usage_asked(body, cached)
            return stream_response(
                outputs, body.n, chunks, last, asked, inputs.limits.sse_keep_alive_interval
            )
        finals = await final_outputs(request, streams)
    if finals is None:
        return None
    log_outputs(inputs.limits, rid, finals)
    if prompt_only:
        finals = [_prompt_alone(out) for out in finals]
    choices = [
        _choice(i * body.n + c.index, out, c, texts[i] if body.echo else None, body, engine.tokenizer)
        for i, out in enumerate(finals)
        for c in out.outputs
    ]
    metrics = request_metrics(streams, inputs.limits)
    return CompletionResponse(
        id=rid, model=model, choices=choices, usage=usage(finals, cached), metrics=metrics
    )


def _prompt_alone(out: RequestOutput) -> RequestOutput:
    empty = [
        CompletionOutput(c.index, "", [], None, None if c.logprobs is None else [], "length", None)
        for c in out.outputs
    ]
    return dataclasses.replace(out, outputs=empty)


async def _without_completions(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    async with contextlib.aclosing(outputs):
        async for i, out in outputs:
            yield i, _prompt_alone(out)


def _choice(
    index: int,
    out: RequestOutput,
    c: CompletionOutput,
    echo: str | None,
    body: CompletionRequest,
    tokenizer: Any,
) -> CompletionChoice:
    text = c.text if echo is None else echo + c.text
    k, logprobs = body.logprobs, None
    if k is not None:
        positions: list[PositionLogprobs | None] = []
        ids: list[int] = []
        if echo is not None:
            positions += out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            ids += out.prompt_token_ids
        positions += c.logprobs or []
        ids += c.token_ids
        logprobs = completion_logprobs(ids, positions, k, 0, tokenizer, body.return_tokens_as_token_ids)
    return CompletionChoice(
        index,
        text,
        logprobs,
        c.finish_reason,
        c.stop_reason,
        prompt_logprobs(out, body.prompt_logprobs),
        ids_if(body.return_token_ids, out.prompt_token_ids),
        ids_if(body.return_token_ids, c.token_ids),
    )


def completion_logprobs(
    ids: list[int],
    positions: list[PositionLogprobs | None],
    k: int,
    offset: int,
    tokenizer: Any,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """The legacy format: the chosen tokens' logprobs and, per position, the top k (plus the chosen).
    Offsets count the tokens as named (as vLLM counts them, "token_id:{id}" included)."""
    out = CompletionLogprobs()
    for token, entry in zip(ids, positions, strict=True):
        out.text_offset.append(offset)
        if entry is None:  # the first prompt token has nothing to condition on
            word = token_text(token, tokenizer.decode([token]), as_ids)
            out.tokens.append(word)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            offset += len(word)
            continue
        chosen = entry[token]
        word = token_text(token, chosen.decoded_token, as_ids)
        out.tokens.append(word)
        out.token_logprobs.append(api_logprob(chosen.logprob))
        out.top_logprobs.append(
            {
                token_text(t, lp.decoded_token, as_ids): api_logprob(lp.logprob)
                for t, lp in entry.items()
                if lp.rank <= k or lp is chosen
            }
        )
        offset += len(word)
    return out


def _chunks(
    rid: str, model: str, body: CompletionRequest, texts: list[str], tokenizer: Any, deltas: list[ChoiceDelta]
) -> list[CompletionResponse]:
    choices = []
    for d in deltas:
        c, echo = d.output, d.first and body.echo
        text = texts[d.prompt] + c.text if echo else c.text
        logprobs = None
        if body.logprobs is not None:
            ids, entries = c.token_ids, c.logprobs or []
            offset = d.offset + (len(texts[d.prompt]) if body.echo else 0)
            if echo:
                prompt = d.request.prompt_token_ids
                ids, entries, offset = (
                    prompt + ids,
                    (d.request.prompt_logprobs or [None] * len(prompt)) + entries,
                    0,
                )
            logprobs = completion_logprobs(
                ids, entries, body.logprobs, offset, tokenizer, body.return_tokens_as_token_ids
            )
        choices.append(
            CompletionChoice(
                d.index,
                text,
                logprobs,
                c.finish_reason,
                c.stop_reason,
                prompt_token_ids=ids_if(body.return_token_ids and d.first, d.request.prompt_token_ids),
                token_ids=ids_if(body.return_token_ids, c.token_ids),
            )
        )
    return [CompletionResponse(id=rid, model=model, choices=choices)]
