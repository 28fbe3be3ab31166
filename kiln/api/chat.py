"""POST /v1/chat/completions: messages through the model's chat template, replies whole or as SSE."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import msgspec
from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from kiln.api.beam_search import beam_search_all, check_beam_search
from kiln.api.chat_reply import Chunks, Reading, chat_logprobs, finish
from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.protocol import ChatCompletionRequest, TextPart, Tool
from kiln.api.request_log import log_outputs, log_requests, logged
from kiln.api.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
)
from kiln.api.serving import (
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
    usage_chunk,
)
from kiln.api.streaming import events, every, sse, stream_interval, usage, usage_asked
from kiln.api.tool_calls import ToolCallStream, call_id, forced_call_schema, mistral_call_id
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.prompt_embeds import SplicedEmbeds
from kiln.engine.request_stream import RequestStream
from kiln.sampling_params import truncate_prompt
from kiln.server_config import ServerConfig


async def create_chat_completion(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: ChatCompletionRequest
) -> ChatCompletionResponse | Response | None:
    generating(engine, "Chat Completions")
    reply = await chat(engine, inputs, request, body, inputs.limits.enable_prompt_tokens_details)
    if reply is None or isinstance(reply, ChatCompletionResponse):
        return reply
    return sse(reply, inputs.limits.sse_keep_alive_interval)


async def chat(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: ChatCompletionRequest, cached: bool
) -> ChatCompletionResponse | AsyncIterator[ChatCompletionChunk] | None:
    """The reply whole, or its chunks as they come (stream), or None if the client left. cached: usage
    with prompt_tokens_details."""
    model = engine.served_name(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    most = engine.admission.max_logprobs
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= most:
        raise APIError(400, f"top_logprobs must be in [0, {most}]", "top_logprobs")
    inputs.check_request(body)
    check_beam_search(body)
    server = inputs.limits
    parser = server.tool_call_parser if server.enable_auto_tool_choice else None
    call_schema, call_name = forced_call_schema(body, auto=parser is not None)
    # A forced call's id, in the form the model's template takes back in the next turn.
    make_id = mistral_call_id if server.tool_call_parser == "mistral" else call_id
    call_stream = functools.partial(ToolCallStream, call_name, make_id)
    calls = call_schema is not None
    # tool_choice "auto": the model may call a tool, in its own format, which the parser reads.
    auto = parser if body.tools and body.tool_choice in (None, "auto") else None
    if auto == "mistral":  # its calls follow a special token, which the text must keep (as vLLM does)
        body = msgspec.structs.replace(body, skip_special_tokens=False)
    so = await constraint(engine, inputs, body, call_schema)
    prompt = await inputs.chat_prompt(body, shown_tools(body, server))
    # As vLLM: the reply's role is the server's (--response-role) where a generation prompt opens a new
    # message, else the last message's; echo starts the reply with that message where it has the role.
    last = body.messages[-1]
    role = inputs.limits.response_role if body.add_generation_prompt else last.role
    echo = _text(last.content) if body.echo and last.role == role else ""
    k = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    side = body.truncation_side or "left"
    keep = body.truncate_prompt_tokens
    if isinstance(prompt, SplicedEmbeds):
        _check_spliced(body, body.echo and last.role == role)
        prompt = prompt.truncated(keep, max_tokens, engine.max_model_len, side)
    else:
        prompt = truncate_prompt(prompt, keep, max_tokens, engine.max_model_len, side)
    params = sampling_params(
        body,
        len(prompt),
        engine.max_model_len,
        max_tokens,
        k,
        body.prompt_logprobs,
        so,
        engine.sampling_defaults,
    )
    prompt_text = await inputs.detokenize(prompt) if body.return_prompt_text else UNSET
    rid = response_id("chatcmpl-", request, body.request_id)
    # A forced call's JSON follows the thinking, unless constraints hold the whole reply.
    think = None if calls and engine.admission.constrain_thinking else engine.reasoning_parser
    reading = functools.partial(Reading.start, think, auto, body.tools or [], body.include_reasoning)
    await log_requests(inputs, rid, [prompt], [params])
    streams: list[RequestStream] = []  # (beam search's requests are its own: no metrics)
    if body.use_beam_search:
        outputs = await beam_search_all(engine, request, body, rid, [prompt], [params])
    else:
        streams = start_all(engine, request, body, rid, [prompt], [params])
        if body.stream:
            last = usage_chunk(ChatCompletionChunk, streams, server, id=rid, model=model)
            chunks = Chunks(rid, model, k, calls, call_stream, body, role, echo, reading, prompt_text)
            outputs = logged(server, rid, 1, merged(streams))
            outputs = every(outputs, stream_interval(body, server.stream_interval))
            return events(outputs, 1, chunks, last, usage_asked(body, cached))
        outputs = await final_outputs(request, streams)
    if outputs is None:
        return None
    log_outputs(server, rid, outputs)
    out = outputs[0]
    choices = []
    for c in out.outputs:
        reason = finish(c.finish_reason, calls)
        r = reading()
        reasoning, content, _ = r.feed(c.text, final=True)
        if calls:
            call = call_stream().whole(content)
            message = AssistantMessage(None, role, call, r.reasoning_field(reasoning))
        else:
            if r.called:
                reason = "tool_calls"  # as vLLM, whatever ended the text
            # Parsed, an empty content is none (vLLM's null); plain, it is the model's empty text.
            text = echo + content if content or r.plain else echo or None
            message = AssistantMessage(
                text, role, r.auto.calls if r.auto else [], r.reasoning_field(reasoning)
            )
        as_ids = body.return_tokens_as_token_ids
        logprobs = None if k is None else chat_logprobs(c.token_ids, c.logprobs or [], k, as_ids)
        ids = ids_if(body.return_token_ids, c.token_ids)
        choices.append(ChatChoice(c.index, message, logprobs, reason, c.stop_reason, ids))
    return ChatCompletionResponse(
        id=rid,
        model=model,
        choices=choices,
        usage=usage(outputs, cached),
        metrics=request_metrics(streams, server),
        prompt_logprobs=prompt_logprobs(out, body.prompt_logprobs),
        prompt_token_ids=ids_if(body.return_token_ids, out.prompt_token_ids),
        prompt_text=prompt_text,
    )


def shown_tools(body: ChatCompletionRequest, server: ServerConfig) -> list[Tool] | None:
    """As vLLM, the template shows the tools even under tool_choice "none", unless the server says not to."""
    hidden = body.tool_choice == "none" and server.exclude_tools_when_tool_choice_none
    return None if hidden else body.tools


def _check_spliced(body: ChatCompletionRequest, echoed: bool) -> None:
    """What a prompt with rows given as embeddings cannot do (vLLM's words where it has them); echoed: the
    last message starts the reply."""
    last = body.messages[-1].content
    if echoed and isinstance(last, list) and any(part.type == "prompt_embeds" for part in last):
        raise APIError(400, "Echo is unsupported with prompt embeds.", "echo")
    if body.return_prompt_text:
        raise APIError(400, "return_prompt_text is not available with prompt embeds", "return_prompt_text")
    if body.use_beam_search:
        raise APIError(400, "use_beam_search is not supported with prompt embeds", "use_beam_search")


def _text(content: str | list[TextPart] | None) -> str:
    if isinstance(content, list):
        return "".join(part.text or "" for part in content)
    return content or ""
