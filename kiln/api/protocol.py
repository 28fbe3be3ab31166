"""Request and response bodies of the OpenAI API (plus vLLM's extra fields), as msgspec Structs.
Requests refuse unknown fields and wrong types (a field kiln does not implement is a 400 that names it,
never silence); responses encode straight to JSON."""

from __future__ import annotations

import time
from typing import Any, Literal, Protocol

import msgspec
from msgspec import UNSET, UnsetType

from kiln.engine.request import PositionLogprobs
from kiln.sampling_params import StructuredOutputsParams

# -- requests --------------------------------------------------------------------------------------


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk too (with include_usage)


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None  # none: any JSON object
    strict: bool | None = None  # kiln always holds the output to the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # informational, as is metadata
    metadata: dict[str, str] | None = None
    response_format: ResponseFormat | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool = False  # token ids beside the text
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:{id}"


class CompletionRequest(_SamplingRequest, kw_only=True):
    prompt: str | list[str | int | list[int]]  # one string, strings, token ids, or lists of ids
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) on a text prompt
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # kiln always holds a forced call to the schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatRender(Protocol):
    """How a request's messages go through the chat template (vLLM's fields): chat and /tokenize."""

    messages: list[ChatMessage] | None
    add_generation_prompt: bool
    continue_final_message: bool  # the last message left open, for the model to go on with it
    add_special_tokens: bool | None  # the tokenizer's special tokens on top of the template's
    chat_template_kwargs: dict[str, Any] | None
    documents: list[dict[str, str]] | None  # for a template that shows them (RAG)


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    echo: bool = False  # vLLM's: the reply starts with the last message, where it has the reply's role
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM's: the reasoning in the reply, with a reasoning parser
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # unset: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


# -- responses -------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
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
    prompt_logprobs: list[PositionLogprobs | None] | UnsetType = UNSET  # vLLM's, as asked
    prompt_token_ids: list[int] | UnsetType = UNSET
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
    prompt_token_ids: list[int] | UnsetType = UNSET  # the first chunk's, with return_token_ids
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = msgspec.field(default_factory=_now)


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    root: str
    max_model_len: int
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


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo
