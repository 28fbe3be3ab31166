"""POST /v1/embeddings (a pooling model's: --runner pooling): each input's embedding, as floats or as
base64 of its bytes (the OpenAI SDK's default)."""

from __future__ import annotations

import base64
import sys

import msgspec
import torch
from starlette.requests import Request

from kiln.api.errors import APIError
from kiln.api.inputs import Inputs, prompt_list
from kiln.api.protocol import EmbeddingRequest, _PooledInputRequest, _ScoringRequest
from kiln.api.request_log import log_requests
from kiln.api.responses import DataList, EmbeddingData
from kiln.api.serving import final_outputs, pooling, response_id, start_all
from kiln.engine.async_engine import AsyncEngine
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import truncate_prompt

# embed_dtype -> (the values' dtype, a same-width dtype numpy has, to take their bytes and swap them)
_DTYPES = {
    "float32": (torch.float32, torch.float32),
    "float16": (torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.int16),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
    "fp8_e5m2": (torch.float8_e5m2, torch.uint8),
}


async def create_embedding(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: EmbeddingRequest
) -> DataList[EmbeddingData] | None:
    pooling(engine, "Embeddings", "embed")
    params = PoolingParams(dimensions=body.dimensions, use_activation=body.use_activation)
    prompts = await prompts_of(inputs, body)
    rid = response_id("embd-", request, body.request_id)
    vectors = await pool(engine, inputs, request, body, rid, prompts, params)
    if vectors is None:
        return None
    data = [EmbeddingData(i, encoded(v, body)) for i, v in enumerate(vectors)]
    return DataList.of(rid, engine.served_name(body.model), data, sum(map(len, prompts)))


async def pool(
    engine: AsyncEngine,
    inputs: Inputs,
    request: Request,
    body: _PooledInputRequest | _ScoringRequest,
    rid: str,
    prompts: list[list[int]],
    params: PoolingParams,
) -> list[torch.Tensor] | None:
    """Each prompt's pooled vector (float32, on the host): its embedding, or its classes' probabilities;
    None if the client left first."""
    await log_requests(inputs, rid, prompts, [params] * len(prompts))
    finals = await final_outputs(
        request, start_all(engine, request, body, rid, prompts, [params] * len(prompts))
    )
    if finals is None:
        return None
    assert all(out.embedding is not None for out in finals)
    return [out.embedding for out in finals]  # type: ignore[misc]


def encoded(v: torch.Tensor, body: EmbeddingRequest) -> list[float] | str:
    """A vector as encoding_format asks: floats, or base64 of its bytes in embed_dtype and endianness."""
    if body.encoding_format == "float":
        return v.tolist()
    dtype, bits = _DTYPES[body.embed_dtype]
    array = v.to(dtype).view(bits).numpy()
    if body.endianness not in ("native", sys.byteorder):
        array = array.byteswap()
    return base64.b64encode(array.tobytes()).decode()


async def prompts_of(inputs: Inputs, body: _PooledInputRequest) -> list[list[int]]:
    if (body.input is None) == (body.messages is None):
        raise APIError(400, "give exactly one of input and messages", "input")
    if body.messages is not None:
        add = body.add_special_tokens is True
        ids = await inputs.chat_ids(msgspec.structs.replace(body, add_special_tokens=add))
        return [truncated(inputs, body, ids)]
    return await inputs.run(_input_ids, inputs, body)


def _input_ids(inputs: Inputs, body: _PooledInputRequest) -> list[list[int]]:
    prompts = prompt_list(body.input)
    limit = inputs.limits.max_completion_prompts
    if len(prompts) > limit:
        raise APIError(
            400, f"a request may hold at most {limit} inputs (server.max_completion_prompts)", "input"
        )
    inputs.check_chars(max(len(p) if isinstance(p, str) else 0 for p in prompts), "input")
    add = body.add_special_tokens is not False
    return [
        truncated(
            inputs, body, inputs.tokenizer.encode(p, add_special_tokens=add) if isinstance(p, str) else p
        )
        for p in prompts
    ]


def truncated(inputs: Inputs, body: _PooledInputRequest | _ScoringRequest, ids: list[int]) -> list[int]:
    """As vLLM's pooling requests: truncate_prompt_tokens (-1: max_model_len) from the tokenizer's side
    unless truncation_side says; an embedding may fill max_model_len, and no more."""
    keep, longest = body.truncate_prompt_tokens, inputs.max_model_len
    if keep is not None and keep > longest:
        raise APIError(
            400,
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len={longest}",
            "truncate_prompt_tokens",
        )
    side = body.truncation_side or inputs.truncation_side
    try:
        ids = truncate_prompt(ids, keep, 0, longest, side)  # nothing is generated: -1 keeps max_model_len
    except ValueError as e:
        raise APIError(400, str(e), "truncate_prompt_tokens") from None
    if len(ids) > longest:
        raise APIError(
            400,
            f"This model's maximum context length is {longest} tokens. However, your prompt contains "
            f"{len(ids)} input tokens. Please reduce the length of the input.",
            "input",
        )
    if not ids:
        raise APIError(400, "input must not be empty", "input")
    if any(not 0 <= t < inputs.vocab_size for t in ids):
        raise APIError(400, f"input token ids must be in [0, {inputs.vocab_size})", "input")
    return ids
