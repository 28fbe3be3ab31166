"""POST /invocations, SageMaker's (as vLLM serves it): a body with messages runs as a chat completion, one
with prompt as a completion, one with input as a response; for a pooling model, any body as embeddings
(a classifier's: classes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request

from kiln.api.chat import create_chat_completion
from kiln.api.classify import create_classification
from kiln.api.completions import create_completion
from kiln.api.embeddings import create_embedding
from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from kiln.api.responses_api import create_response
from kiln.api.responses_protocol import ResponsesRequest
from kiln.engine.async_engine import AsyncEngine

_ROUTES = (
    ("messages", create_chat_completion, ChatCompletionRequest),
    ("prompt", create_completion, CompletionRequest),
    ("input", create_response, ResponsesRequest),
)


async def create_invocation(
    engine: AsyncEngine,
    inputs: Inputs,
    request: Request,
    raw: msgspec.Raw,
    check_model: Callable[[Any], None],
) -> Any:
    """check_model: the app's check of the body's `model` (a 404 for one it does not serve)."""
    data = bytes(raw)
    try:  # the top level's keys only: its values stay raw, unparsed
        keys = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        raise APIError(400, "an invocation's body must be a JSON object") from None
    if engine.pooler is not None:
        classify = engine.pooler.task == "classify"
        body = await inputs.parse(data, ClassificationRequest if classify else EmbeddingRequest)
        check_model(body)
        handler = create_classification if classify else create_embedding
        return await handler(engine, inputs, request, body)  # type: ignore[arg-type]
    for key, handler, kind in _ROUTES:
        if key in keys:
            body = await inputs.parse(data, kind)
            check_model(body)
            return await handler(engine, inputs, request, body)
    raise APIError(400, "an invocation needs messages (chat), prompt (completions) or input (responses)")
