"""What completions and chat share: sampling params from a request, starting its engine requests,
running several engine streams as one, and waiting for a non-streamed result while watching for the
client to leave. What they stream, and their usage, is in kiln.api.streaming."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from msgspec import UNSET, UnsetType
from starlette.requests import Request

from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.protocol import _PooledInputRequest, _SamplingRequest, _ScoringRequest
from kiln.api.responses import RequestMetrics
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.prompt_embeds import GivenPrompt
from kiln.engine.request import PositionLogprobs
from kiln.engine.request_output import RequestOutput, merge
from kiln.engine.request_stream import RequestStream
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams, StructuredOutputsParams
from kiln.server_config import ServerConfig

T = TypeVar("T")

# The sampling fields a request may leave unset for the model's generation config to set.
_DEFAULTED = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)  # fmt: skip


def sampling_params(
    body: _SamplingRequest,
    prompt_len: int,
    max_model_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """OpenAI fields to SamplingParams; a field left unset (None) takes the model's default (defaults: its
    generation config's, as vLLM), else OpenAI's. A prompt plus max_tokens that would not fit in the
    model's context is a 400, as in vLLM. The prompt comes truncated already (truncate_prompt_tokens)."""
    defaults = defaults or {}
    room = max_model_len - prompt_len
    if max_tokens is not None and max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
            "completion). Please reduce the length of the prompt or completion.",
            "max_tokens",
        )
    bias = None
    if body.logit_bias:
        try:
            bias = {int(k): v for k, v in body.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from None
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    optional = {
        name: value if (value := getattr(body, name)) is not None else defaults.get(name)
        for name in _DEFAULTED
    }
    if max_tokens is None:  # (an explicit 0 is SamplingParams' 400)
        max_tokens = max(min(defaults.get("max_tokens", room), room), 1)
    return SamplingParams(
        n=body.n,
        logit_bias=bias,
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=stop,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs,
        allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words or [],
        repetition_detection=body.repetition_detection,
        thinking_token_budget=body.thinking_token_budget,
        **{k: v for k, v in optional.items() if v is not None},
    )


async def constraint(
    engine: AsyncEngine,
    inputs: Inputs,
    body: _SamplingRequest,
    forced_call: dict[str, Any] | None = None,
) -> StructuredOutputsParams | None:
    """What the request constrains its output to: response_format, vLLM's structured_outputs, or a forced
    tool call's schema (at most one). Parsed here, on the inputs worker when the body is large, so a bad
    constraint is a 400 naming its field before anything is queued."""
    asked: list[tuple[str, StructuredOutputsParams]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema" and fmt.json_schema is None:
            raise APIError(
                400, 'response_format of type "json_schema" needs its json_schema', "response_format"
            )
        schema = fmt.json_schema.schema if fmt.json_schema is not None else None
        parts = {"format": fmt.format, "structures": fmt.structures, "triggers": fmt.triggers}
        given = [k for k, v in parts.items() if v is not None]
        if given and fmt.type != "structural_tag":
            raise APIError(
                400, f"response_format.{given[0]} goes only with type structural_tag", "response_format"
            )
        if fmt.type == "structural_tag":
            tag = {"type": "structural_tag"} | {k: parts[k] for k in given}
            so = StructuredOutputsParams(structural_tag=json.dumps(tag, ensure_ascii=False))
        elif schema is not None:
            so = StructuredOutputsParams(json=schema)
        else:
            so = StructuredOutputsParams(json_object=True)
        asked.append(("response_format", so))
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", body.structured_outputs))
    if forced_call is not None:
        asked.append(("tool_choice", StructuredOutputsParams(json=forced_call)))
    if len(asked) > 1:
        raise APIError(400, f"give only one constraint, not {' and '.join(k for k, _ in asked)}", asked[1][0])
    if not asked:
        return None
    field, so = asked[0]
    try:
        await inputs.run(engine.check_constraint, so)
    except ValueError as e:
        raise APIError(400, str(e), field) from None
    return so


def generating(engine: AsyncEngine, api: str) -> None:
    """A pooling model serves embeddings only: its generation APIs answer 501, as vLLM's."""
    if engine.pooler is not None:
        raise APIError(501, f"The model does not support {api} API")


def pooling(engine: AsyncEngine, api: str, task: str | None = "embed") -> None:
    """A pooling API of another task than the model's (embed: embeddings and scores; classify; None: any,
    as /pooling), or of a generating model, answers 501, as vLLM's."""
    if engine.pooler is None or task not in (None, engine.pooler.task):
        raise APIError(501, f"The model does not support {api} API")


def response_id(prefix: str, request: Request, request_id: str | None) -> str:
    """vLLM's: the X-Request-Id header, else the body's request_id, else a random id, after the prefix."""
    return f"{prefix}{request.headers.get('x-request-id') or request_id or uuid.uuid4().hex}"


def start_all(
    engine: AsyncEngine,
    request: Request,
    body: _SamplingRequest | _PooledInputRequest | _ScoringRequest,
    response_id: str,
    prompts: Sequence[list[int] | GivenPrompt],
    params: Sequence[SamplingParams | PoolingParams],
) -> list[RequestStream]:
    """One engine request per prompt, with the body's priority and cache_salt; if any is refused, none
    stays queued. Engine ids get a random suffix, as in vLLM: clients may reuse their request ids."""
    priority = body.priority
    header = request.headers.get("x-vllm-priority")
    if header is not None:
        try:
            priority = int(header)
        except ValueError:
            message = f"the X-Vllm-Priority header must be an integer, not {header!r}"
            raise APIError(400, message, "priority") from None
    engine_id = f"{response_id}-{uuid.uuid4().hex[:8]}"
    lora = engine.served_loras.get(body.model) if body.model else None
    streams: list[RequestStream] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            rid = f"{engine_id}-{i}" if len(prompts) > 1 else engine_id
            streams.append(engine.generate(ids, p, rid, priority, body.cache_salt, lora))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come. Leaving early aborts what is unfinished."""
    if len(streams) == 1:  # the common case needs no task per output
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        for s in streams:
            s.close()


async def final_outputs(request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
    """The whole output of each stream, or None if the client disconnected first (which aborts)."""
    deltas: list[list[RequestOutput]] = [[] for _ in streams]

    async def run() -> None:
        async for i, out in merged(streams):
            deltas[i].append(out)

    work = asyncio.ensure_future(run())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # the client left (or the server is stopping): abort through merged()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return None
    work.result()
    return [merge(d) for d in deltas]


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def prompt_logprobs(out: RequestOutput, k: int | None) -> list[PositionLogprobs | None] | UnsetType:
    """vLLM's prompt_logprobs of one prompt: each position's token and its k most likely (the engine may
    have computed more, for echo's logprobs); left out unless asked."""
    if k is None or out.prompt_logprobs is None:
        return UNSET
    return [
        None if entry is None else {t: lp for t, lp in entry.items() if lp.rank <= k or t == token}
        for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)
    ]


def api_logprob(value: float) -> float:
    """vLLM's: a token filtered out (-inf: a grammar's mask, a processed logprobs mode's cut) as -9999.0,
    which JSON can carry."""
    return max(value, -9999.0)


def token_text(token_id: int, text: str, as_ids: bool) -> str:
    """A logprob's token as a response names it: its text, or vLLM's "token_id:{id}"
    (return_tokens_as_token_ids, for tokens whose text is not valid UTF-8 alone)."""
    return f"token_id:{token_id}" if as_ids else text


def ids_if(asked: bool, ids: list[int]) -> list[int] | UnsetType:
    """vLLM's return_token_ids: the ids when asked, else left out of the response."""
    return ids if asked else UNSET


def request_metrics(streams: Sequence[RequestStream], server: ServerConfig) -> RequestMetrics | UnsetType:
    """vLLM's per-request metrics (--enable-per-request-metrics), for one prompt of one sequence, as vLLM
    gives them (several would not be one request's timings)."""
    if not server.enable_per_request_metrics or len(streams) != 1 or streams[0].seqs != 1:
        return UNSET
    s = streams[0]
    scheduled, first, last, n = s.scheduled_at, s.first_token_at, s.last_token_at, s.num_tokens

    def ms(start: float, end: float) -> float | None:
        return (end - start) * 1000 if start and end else None

    return RequestMetrics(
        time_to_first_token_ms=ms(scheduled, first),
        generation_time_ms=ms(first, last),
        queue_time_ms=ms(s.arrival, scheduled),
        mean_itl_ms=(last - first) * 1000 / (n - 1) if first and n > 1 else None,
        tokens_per_second=n / (last - scheduled) if scheduled and last > scheduled else None,
    )


def usage_chunk(
    kind: Callable[..., T], streams: Sequence[RequestStream], server: ServerConfig, **fixed: Any
) -> Callable[..., T]:
    """A stream's last chunk, of the endpoint's kind: its usage, and the request's metrics as they stand
    when it is sent (at the end)."""
    return lambda **fields: kind(**fixed, **fields, metrics=request_metrics(streams, server))
