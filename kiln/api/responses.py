"""Response bodies of the OpenAI API (plus vLLM's extra fields), as msgspec Structs that encode straight
to JSON. A field a request did not ask for is left out where it is UNSET."""

from __future__ import annotations

import time
from typing import Generic, Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from kiln.api.protocol import ToolCall
from kiln.engine.request import PositionLogprobs

D = TypeVar("D")  # a DataList's item


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET  # --enable-prompt-tokens-details


class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's, left out unless asked: the prompt's logprobs (whole responses only), its ids (a choice's first
    # chunk when streamed) and the output's ids (each chunk's own).
    prompt_logprobs: list[PositionLogprobs | None] | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class RequestMetrics(msgspec.Struct):
    """vLLM's per-request metrics (--enable-per-request-metrics), from when the request was first
    scheduled; a field is null where its times are unknown (mean_itl_ms: one token)."""

    time_to_first_token_ms: float | None
    generation_time_ms: float | None  # first token to last
    queue_time_ms: float | None
    mean_itl_ms: float | None
    tokens_per_second: float | None  # output tokens over the time from scheduling to the last


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: RequestMetrics | UnsetType = UNSET
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=_now)


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    reasoning: str | UnsetType | None = UNSET  # vLLM's, with a reasoning parser


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: RequestMetrics | UnsetType = UNSET
    prompt_logprobs: list[PositionLogprobs | None] | UnsetType = UNSET  # vLLM's, as asked
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_text: str | UnsetType = UNSET  # vLLM's return_prompt_text
    object: Literal["chat.completion"] = "chat.completion"
    created: int = msgspec.field(default_factory=_now)


class DeltaFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    function: DeltaFunction
    id: str | None = None
    type: Literal["function"] | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    metrics: RequestMetrics | UnsetType = UNSET  # on the usage chunk
    prompt_token_ids: list[int] | UnsetType = UNSET  # the first chunk's, with return_token_ids
    prompt_text: str | UnsetType = UNSET  # the first chunk's, with return_prompt_text
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = msgspec.field(default_factory=_now)


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    root: str
    max_model_len: int | None = None  # None for an adapter, as vLLM's
    object: Literal["model"] = "model"
    created: int = msgspec.field(default_factory=_now)
    owned_by: str = "kiln"
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | UnsetType = UNSET  # vLLM's return_token_strs: each token as the vocabulary has it


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # base64: the values' bytes
    object: Literal["embedding"] = "embedding"


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: Literal["score"] = "score"


class RerankDocument(msgspec.Struct):
    text: str
    multi_modal: None = None


class RerankResult(msgspec.Struct):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationData(msgspec.Struct):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class PoolingData(msgspec.Struct):
    index: int
    data: list[float] | str  # base64: the values' bytes
    object: Literal["pooling"] = "pooling"


class DataList(msgspec.Struct, Generic[D]):
    """The pooling APIs' response (OpenAI's for embeddings, vLLM's for the rest): one data item per input,
    and the prompt tokens they took."""

    id: str
    model: str
    data: list[D]
    usage: Usage
    object: Literal["list"] = "list"
    created: int = msgspec.field(default_factory=_now)

    @classmethod
    def of(cls, id: str, model: str, data: list[D], prompt_tokens: int) -> DataList[D]:
        return cls(id, model, data, Usage(prompt_tokens, 0, prompt_tokens))
