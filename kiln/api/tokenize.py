"""POST /tokenize and /detokenize (vLLM's): a prompt or messages to ids, and ids to text."""

from __future__ import annotations

import msgspec
from starlette.requests import Request

from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.protocol import DetokenizeRequest, TokenizeRequest
from kiln.api.responses import DetokenizeResponse, TokenizeResponse
from kiln.engine.async_engine import AsyncEngine


async def tokenize(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: TokenizeRequest
) -> TokenizeResponse:
    if body.messages is not None and body.prompt is None:
        ids = await inputs.chat_ids(body)
    elif body.prompt is not None and body.messages is None:
        ids = await inputs.tokenize(body.prompt, body.add_special_tokens is not False)
    else:
        raise APIError(400, "give exactly one of prompt and messages", "prompt")
    strs = (
        await inputs.run(inputs.tokenizer.convert_ids_to_tokens, ids)
        if body.return_token_strs
        else msgspec.UNSET
    )
    return TokenizeResponse(len(ids), engine.max_model_len, ids, strs)


async def detokenize(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: DetokenizeRequest
) -> DetokenizeResponse:
    return DetokenizeResponse(await inputs.detokenize(body.tokens))
