"""POST /v1/chat/completions: messages through the model's chat template, replies whole or as SSE."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
from msgspec import UNSET, UnsetType
from starlette.requests import Request
from starlette.responses import Response

from kiln.api.beam_search import beam_search_all, check_beam_search
from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.protocol import ChatCompletionRequest, TextPart, Tool
from kiln.api.reasoning import ThinkSplit
from kiln.api.request_log import log_outputs, log_requests, logged
from kiln.api.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    Delta,
    DeltaToolCall,
    TokenLogprob,
    TopLogprob,
)
from kiln.api.serving import (
    api_logprob,
    constraint,
    final_outputs,
    generating,
    ids_if,
    merged,
    prompt_logprobs,
    response_id,
    sampling_params,
    start_all,
    token_text,
)
from kiln.api.streaming import ChoiceDelta, events, every, sse, stream_interval, usage, usage_asked
from kiln.api.tool_calls import ToolCallStream, call_id, forced_call_schema, mistral_call_id
from kiln.api.tool_parser import Parser, parser_for
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.request import PositionLogprobs
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
    ids = await inputs.chat_ids(body, shown_tools(body, server))
    # As vLLM: the reply's role is the server's (--response-role) where a generation prompt opens a new
    # message, else the last message's; echo starts the reply with that message where it has the role.
    last = body.messages[-1]
    role = inputs.limits.response_role if body.add_generation_prompt else last.role
    echo = _text(last.content) if body.echo and last.role == role else ""
    k = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    side = body.truncation_side or "left"
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, max_tokens, engine.max_model_len, side)
    params = sampling_params(
        body,
        len(ids),
        engine.max_model_len,
        max_tokens,
        k,
        body.prompt_logprobs,
        so,
        engine.sampling_defaults,
    )
    prompt_text = await inputs.detokenize(ids) if body.return_prompt_text else UNSET
    rid = response_id("chatcmpl-", request, body.request_id)
    # A forced call's JSON follows the thinking, unless constraints hold the whole reply.
    think = None if calls and engine.admission.constrain_thinking else engine.reasoning_parser
    reading = functools.partial(_Reading.start, think, auto, body.tools or [], body.include_reasoning)
    await log_requests(inputs, rid, [ids], [params])
    if body.use_beam_search:
        outputs = await beam_search_all(engine, request, body, rid, [ids], [params])
    else:
        streams = start_all(engine, request, body, rid, [ids], [params])
        if body.stream:
            usage_chunk = functools.partial(ChatCompletionChunk, id=rid, model=model)
            chunks = _Chunks(rid, model, k, calls, call_stream, body, role, echo, reading, prompt_text)
            outputs = logged(server, rid, 1, merged(streams))
            outputs = every(outputs, stream_interval(body, server.stream_interval))
            return events(outputs, 1, chunks, usage_chunk, usage_asked(body, cached))
        outputs = await final_outputs(request, streams)
    if outputs is None:
        return None
    log_outputs(server, rid, outputs)
    out = outputs[0]
    choices = []
    for c in out.outputs:
        reason = _finish(c.finish_reason, calls)
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
        prompt_logprobs=prompt_logprobs(out, body.prompt_logprobs),
        prompt_token_ids=ids_if(body.return_token_ids, out.prompt_token_ids),
        prompt_text=prompt_text,
    )


def shown_tools(body: ChatCompletionRequest, server: ServerConfig) -> list[Tool] | None:
    """As vLLM, the template shows the tools even under tool_choice "none", unless the server says not to."""
    hidden = body.tool_choice == "none" and server.exclude_tools_when_tool_choice_none
    return None if hidden else body.tools


def _text(content: str | list[TextPart] | None) -> str:
    if isinstance(content, list):
        return "".join(part.text or "" for part in content)
    return content or ""


def _finish(reason: str | None, calls: bool) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def chat_logprobs(
    ids: list[int], positions: list[PositionLogprobs], k: int, as_ids: bool = False
) -> ChatLogprobs:
    content = []
    for token, entry in zip(ids, positions, strict=True):
        chosen = token_text(token, entry[token].decoded_token, as_ids)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda e: e[1].rank)[:k]
        named = [(token_text(t, lp.decoded_token, as_ids), api_logprob(lp.logprob)) for t, lp in top]
        content.append(
            TokenLogprob(
                chosen,
                api_logprob(entry[token].logprob),
                list(chosen.encode()),
                [TopLogprob(text, logprob, list(text.encode())) for text, logprob in named],
            )
        )
    return ChatLogprobs(content)


@dataclass(slots=True)
class _Reading:
    """How a choice's text becomes its message: a reasoning model's thinking apart (model.reasoning_parser),
    then the calls the model chose (tool_choice "auto"), the rest content (or a forced call's JSON)."""

    think: ThinkSplit | None
    auto: Parser | None
    include_reasoning: bool

    @classmethod
    def start(
        cls, think: str | None, auto: str | None, tools: list[Tool], include_reasoning: bool
    ) -> _Reading:
        return cls(
            None if think is None else ThinkSplit(think),
            None if auto is None else parser_for(auto, tools),
            include_reasoning,
        )

    def feed(self, text: str, final: bool) -> tuple[str, str, list[DeltaToolCall]]:
        """(reasoning, content, calls) new in this text."""
        reasoning = ""
        if self.think is not None:
            reasoning, text = self.think.feed(text, final)
        if self.auto is None:
            return reasoning, text, []
        content, calls = self.auto.feed(text, final)
        return reasoning, content, calls

    @property
    def plain(self) -> bool:
        return self.think is None and self.auto is None

    @property
    def called(self) -> bool:
        return self.auto is not None and bool(self.auto.calls)

    def reasoning_field(self, reasoning: str) -> str | UnsetType | None:
        """The message's `reasoning`: left out without a reasoning parser, or when the request asks so."""
        if self.think is None or not self.include_reasoning:
            return UNSET
        return reasoning or None


class _Chunks:
    """A stream's chunks: a role chunk to open each choice (as OpenAI), then its content (and reasoning, and
    the calls it chose, as _Reading sets them apart), or its tool-call deltas when a call is forced."""

    def __init__(
        self,
        rid: str,
        model: str,
        k: int | None,
        calls: bool,
        call_stream: Callable[[], ToolCallStream],
        body: ChatCompletionRequest,
        role: str,
        echo: str,
        reading: Callable[[], _Reading],
        prompt_text: str | UnsetType,
    ) -> None:
        self.rid, self.model, self.k = rid, model, k
        self.prompt_text = prompt_text
        self.role, self.echo = role, echo
        self.reading = reading
        self.readings: dict[int, _Reading] = {}  # each choice's
        self.calls: dict[int, ToolCallStream] | None = {} if calls else None
        self.call_stream = call_stream
        self.as_ids, self.return_ids = body.return_tokens_as_token_ids, body.return_token_ids
        self.opened = False  # the stream's first chunk is out (it carries the prompt's ids and text if asked)

    def __call__(self, deltas: list[ChoiceDelta]) -> list[ChatCompletionChunk]:
        out, choices = [], []
        for d in deltas:
            if d.first:
                opening = Delta(role=self.role, content="" if self.calls is None else None)
                out.append(self._chunk([ChatChunkChoice(d.index, opening)]))
                if not self.opened:
                    if self.return_ids:
                        out[-1].prompt_token_ids = d.request.prompt_token_ids
                    out[-1].prompt_text = self.prompt_text
                self.opened = True
                if self.echo and self.calls is None:
                    out.append(self._chunk([ChatChunkChoice(d.index, Delta(content=self.echo))]))
            c = d.output
            logprobs = None
            if self.k is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs or [], self.k, self.as_ids)
            reason = _finish(c.finish_reason, self.calls is not None)
            r = self.readings.get(d.index)
            if r is None:
                r = self.readings[d.index] = self.reading()
            reasoning, content, found = r.feed(c.text, final=c.finish_reason is not None)
            shown = reasoning if r.include_reasoning else ""
            if self.calls is not None:
                stream = self.calls.get(d.index)
                if stream is None:
                    stream = self.calls[d.index] = self.call_stream()
                delta = Delta(reasoning=shown or None, tool_calls=stream.feed(content) or None)
            else:
                if r.plain:
                    delta = Delta(content=content)  # as it came, an empty text included
                else:
                    delta = Delta(content=content or None, reasoning=shown or None, tool_calls=found or None)
                reason = "tool_calls" if r.called and reason is not None else reason
            ids = ids_if(self.return_ids, c.token_ids)
            choices.append(ChatChunkChoice(d.index, delta, logprobs, reason, c.stop_reason, ids))
        out.append(self._chunk(choices))
        return out

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, model=self.model, choices=choices)
