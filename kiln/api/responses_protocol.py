"""OpenAI's Responses API (POST /v1/responses): its request, as a msgspec Struct that refuses what kiln does
not implement, and its response object and output items. Its stream's events are plain dicts
(kiln.api.responses_stream)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from kiln.api.protocol import ReasoningEffort, _Strict
from kiln.api.responses import TokenLogprob, Usage
from kiln.sampling_params import StructuredOutputsParams


class TextFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None  # json_schema's
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # kiln always holds the output to the schema


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # kiln writes no summaries: a 400


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Strict):
    """OpenAI's fields, then vLLM's extras. `input` items are read by kiln.api.responses_api."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None  # a system message before the input
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] = 0
    stream: bool = False
    store: bool = True  # kiln keeps no responses: each says "store": false
    previous_response_id: str | None = None  # so none can be continued: a 404
    background: bool = False
    truncation: Literal["auto", "disabled"] = "disabled"
    metadata: dict[str, str] | None = None
    user: str | None = None  # informational, as are the next three
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    session_id: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    thinking_token_budget: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprob] | UnsetType = UNSET


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


class MessageItem(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type"):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: str = "completed"


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseBody(msgspec.Struct, kw_only=True):
    id: str
    model: str
    status: Literal["completed", "incomplete", "in_progress"]
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    # The request's settings, echoed as OpenAI does.
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[FunctionTool]
    tool_choice: str | NamedFunction
    parallel_tool_calls: bool
    text: TextConfig
    reasoning: ReasoningConfig | None
    metadata: dict[str, str]
    user: str | None
    truncation: str = "disabled"
    store: bool = False
    previous_response_id: None = None
    error: None = None
    object: Literal["response"] = "response"
    created_at: int = msgspec.field(default_factory=lambda: int(time.time()))


def item_id(kind: str) -> str:
    """An output item's id: msg_..., rs_..., fc_..."""
    return f"{kind}_{uuid.uuid4().hex}"


def response_usage(usage: Usage, reasoning_tokens: int) -> ResponseUsage:
    """The chat usage in the Responses API's names."""
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if not isinstance(details, UnsetType) else 0
    return ResponseUsage(
        usage.prompt_tokens,
        InputTokensDetails(cached),
        usage.completion_tokens,
        OutputTokensDetails(reasoning_tokens),
        usage.total_tokens,
    )


def response_body(
    request: ResponsesRequest,
    rid: str,
    model: str,
    finish_reason: str | None,
    items: list[OutputItem],
    usage: ResponseUsage | None,
) -> ResponseBody:
    """The response object, with the request's settings; finish_reason None: still in progress."""
    status, incomplete = "completed", None
    if finish_reason is None:
        status = "in_progress"
    elif finish_reason == "length":
        status, incomplete = "incomplete", IncompleteDetails("max_output_tokens")
    return ResponseBody(
        id=rid,
        model=model,
        status=status,
        output=items,
        usage=usage,
        incomplete_details=incomplete,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        tools=request.tools or [],
        tool_choice=request.tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        text=request.text or TextConfig(TextFormat("text")),
        reasoning=request.reasoning,
        metadata=request.metadata or {},
        user=request.user,
    )
