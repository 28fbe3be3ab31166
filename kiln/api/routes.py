"""The paths that run the model, each with its handler and its body's type: GET /load counts their
requests (as vLLM's load_aware_call), and `kiln run-batch` takes them as a batch line's `url`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from kiln.api.chat import create_chat_completion
from kiln.api.classify import create_classification
from kiln.api.completions import create_completion
from kiln.api.embeddings import create_embedding
from kiln.api.inputs import Inputs
from kiln.api.messages import count_tokens, create_message
from kiln.api.messages_protocol import CountTokensRequest, MessagesRequest
from kiln.api.pooling import create_pooling
from kiln.api.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from kiln.api.responses_api import create_response
from kiln.api.responses_protocol import ResponsesRequest
from kiln.api.scores import create_rerank, create_score
from kiln.engine.async_engine import AsyncEngine

Handler = Callable[[AsyncEngine, Inputs, Request, Any], Awaitable[Any]]

WORK: list[tuple[str, Handler, type]] = [
    ("/v1/completions", create_completion, CompletionRequest),
    ("/v1/chat/completions", create_chat_completion, ChatCompletionRequest),
    ("/v1/responses", create_response, ResponsesRequest),
    ("/v1/embeddings", create_embedding, EmbeddingRequest),
    ("/classify", create_classification, ClassificationRequest),
    ("/pooling", create_pooling, PoolingRequest),
    *((p, create_score, ScoreRequest) for p in ("/score", "/v1/score")),
    *((p, create_rerank, RerankRequest) for p in ("/rerank", "/v1/rerank", "/v2/rerank")),
]
# Anthropic's: its error shape, and its x-api-key header beside Bearer keys.
ANTHROPIC: list[tuple[str, Handler, type]] = [
    ("/v1/messages", create_message, MessagesRequest),
    ("/v1/messages/count_tokens", count_tokens, CountTokensRequest),
]
