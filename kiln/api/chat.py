"""POST /v1/chat/completions: messages through the model's chat template, replies whole or as SSE."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kiln.api.errors import APIError
from kiln.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    Delta,
    TokenLogprob,
    TopLogprob,
)
from kiln.api.serving import final_outputs, merged, sampling_params, sse, start_all, usage
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.outputs import RequestOutput
from kiln.engine.request import PositionLogprobs


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    plain = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(400, "only text content parts are supported", "messages")
            content = "".join(part.text or "" for part in content)
        plain.append({"role": m.role, "content": content or ""})
    if tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    try:
        return tokenizer.apply_chat_template(
            plain,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **(chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja raises for conversations the template refuses
        raise APIError(400, f"the chat template rejected these messages: {e}", "messages") from None


async def create_chat_completion(
    engine: AsyncEngine, request: Request, body: ChatCompletionRequest
) -> ChatCompletionResponse | Response | None:
    model = engine.model_name
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    ids = render_chat(engine.tokenizer, body.messages, body.add_generation_prompt, body.chat_template_kwargs)
    k = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, len(ids), engine.max_model_len, max_tokens, k)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = start_all(engine, rid, [ids], [params])
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse(_chunks(merged(streams), rid, model, k, include_usage))
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


async def _chunks(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    rid: str,
    model: str,
    k: int | None,
    include_usage: bool,
) -> AsyncIterator[ChatCompletionChunk]:
    sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) already sent
    final: RequestOutput | None = None
    async for _, out in outputs:
        choices = []
        for c in out.outputs:
            if c.index not in sent:  # as OpenAI: a chunk with the role alone opens each choice
                sent[c.index] = (0, 0)
                role = ChatChunkChoice(c.index, Delta(role="assistant", content=""))
                yield ChatCompletionChunk(id=rid, model=model, choices=[role])
            chars, tokens = sent[c.index]
            if len(c.text) == chars and len(c.token_ids) == tokens and not c.finished:
                continue
            logprobs = None
            if k is not None:
                logprobs = chat_logprobs(c.token_ids[tokens:], (c.logprobs or [])[tokens:], k)
            sent[c.index] = (len(c.text), len(c.token_ids))
            delta = Delta(content=c.text[chars:])
            choices.append(ChatChunkChoice(c.index, delta, logprobs, c.finish_reason, c.stop_reason))
        if out.finished:
            final = out
        if choices:
            yield ChatCompletionChunk(id=rid, model=model, choices=choices)
    if include_usage and final is not None:
        yield ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage([final]))
