"""POST /v1/chat/completions: messages through the model's chat template, replies whole or as SSE."""

from __future__ import annotations

import functools
import uuid

from starlette.requests import Request
from starlette.responses import Response

from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    Delta,
    TokenLogprob,
    TopLogprob,
)
from kiln.api.serving import (
    ChoiceDelta,
    final_outputs,
    merged,
    sampling_params,
    start_all,
    stream_response,
    usage,
)
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.engine import MAX_LOGPROBS
from kiln.engine.request import PositionLogprobs


async def create_chat_completion(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: ChatCompletionRequest
) -> ChatCompletionResponse | Response | None:
    model = engine.model_name
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
    inputs.check_request(body)
    ids = await inputs.chat_ids(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
    k = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, len(ids), engine.max_model_len, max_tokens, k)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = start_all(engine, rid, [ids], [params])
    if body.stream:
        usage_chunk = None
        if body.stream_options is not None and body.stream_options.include_usage:
            usage_chunk = functools.partial(ChatCompletionChunk, id=rid, model=model)
        return stream_response(merged(streams), 1, functools.partial(_chunks, rid, model, k), usage_chunk)
    outputs = await final_outputs(request, streams)
    if outputs is None:
        return None
    out = outputs[0]
    choices = [
        ChatChoice(
            c.index,
            AssistantMessage(c.text),
            None if k is None else chat_logprobs(c.token_ids, c.logprobs or [], k),
            c.finish_reason,
            c.stop_reason,
        )
        for c in out.outputs
    ]
    return ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage(outputs))


def chat_logprobs(ids: list[int], positions: list[PositionLogprobs], k: int) -> ChatLogprobs:
    content = []
    for token, entry in zip(ids, positions, strict=True):
        chosen = entry[token]
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)[:k]
        content.append(
            TokenLogprob(
                chosen.decoded_token,
                chosen.logprob,
                list(chosen.decoded_token.encode()),
                [TopLogprob(lp.decoded_token, lp.logprob, list(lp.decoded_token.encode())) for lp in top],
            )
        )
    return ChatLogprobs(content)


def _chunks(rid: str, model: str, k: int | None, deltas: list[ChoiceDelta]) -> list[ChatCompletionChunk]:
    out, choices = [], []
    for d in deltas:
        if d.first:  # as OpenAI: a chunk with the role alone opens each choice
            role = ChatChunkChoice(d.index, Delta(role="assistant", content=""))
            out.append(ChatCompletionChunk(id=rid, model=model, choices=[role]))
        c = d.output
        logprobs = None if k is None else chat_logprobs(c.token_ids, c.logprobs or [], k)
        choices.append(
            ChatChunkChoice(d.index, Delta(content=c.text), logprobs, c.finish_reason, c.stop_reason)
        )
    out.append(ChatCompletionChunk(id=rid, model=model, choices=choices))
    return out
