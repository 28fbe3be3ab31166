"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens, as vLLM serves them), as
msgspec Structs: the request, refused where it names a field kiln does not implement, and the reply, whole
or as stream events. The conversion to and from the chat path is kiln.api.messages."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from kiln.sampling_params import StructuredOutputsParams

Effort = Literal["low", "medium", "high", "xhigh", "max"]
# A prompt-caching hint on a block or tool. kiln's prefix cache keeps every prefix without one.
CacheControl = dict[str, Any] | None


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class _Block(_Strict, tag_field="type"):
    cache_control: CacheControl = None


class TextBlock(_Block, tag="text", kw_only=True):
    text: str
    citations: list[dict[str, Any]] | None = None  # an earlier reply's, sent back; not shown to the model


class ImageBlock(_Block, tag="image", kw_only=True):
    source: dict[str, Any]  # accepted so that the refusal can say why: kiln serves text-only models


class ToolUseBlock(_Block, tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block, tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool = False  # as vLLM, the template sees only the content (which says what failed)


class ThinkingBlock(_Block, tag="thinking", kw_only=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block, tag="redacted_thinking", kw_only=True):
    data: str  # opaque: sent back by clients, left out of the prompt (vLLM's)


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class Message(_Strict):
    # "system": vLLM's, for clients (Claude Code) that put reminders between the turns.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolDefinition(_Strict):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl = None
    eager_input_streaming: bool | None = None  # kiln streams every call's input as it comes


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # the tool, for type "tool"
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Strict):
    """enabled: thinking_token_budget; disabled: the reasoning_effort the server maps it to (vLLM's
    --anthropic-disabled-thinking-effort); adaptive: the model's own. `display` is accepted and the thinking
    always returned, as vLLM: left out, it would be missing from the next turn's history."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Meta(ge=1024)] | None = None
    display: Literal["summarized", "omitted", "updates"] | None = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(_Strict):
    effort: Effort | None = None  # the template's reasoning_effort
    format: JsonOutputFormat | None = None


class Metadata(_Strict):
    user_id: str | None = None


class InputTokens(_Strict, tag_field="type", tag="input_tokens"):
    value: Annotated[int, Meta(ge=0)]


class ToolUses(_Strict, tag_field="type", tag="tool_uses"):
    value: Annotated[int, Meta(ge=0)]


class ThinkingTurns(_Strict, tag_field="type", tag="thinking_turns"):
    value: Annotated[int, Meta(ge=1)]


class AllThinkingTurns(_Strict, tag_field="type", tag="all"):
    pass


class ClearToolUses(_Strict, tag_field="type", tag="clear_tool_uses_20250919"):
    """Once the prompt passes `trigger`, the oldest tool results (and, asked, their calls' inputs) become a
    placeholder, all but the last `keep` uses, unless that clears fewer than `clear_at_least` tokens."""

    trigger: InputTokens | ToolUses = msgspec.field(default_factory=lambda: InputTokens(value=100_000))
    keep: ToolUses = msgspec.field(default_factory=lambda: ToolUses(value=3))
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None  # a list: the tools whose inputs are cleared


class ClearThinking(_Strict, tag_field="type", tag="clear_thinking_20251015"):
    """The thinking of all but the last `keep` assistant turns left out."""

    keep: ThinkingTurns | AllThinkingTurns | Literal["all"] = msgspec.field(
        default_factory=lambda: ThinkingTurns(value=1)
    )


class ContextManagement(_Strict):
    """Anthropic's context editing, applied before the prompt is rendered (kiln.api.context_edits)."""

    edits: list[ClearToolUses | ClearThinking]


class _Conversation(_Strict):
    """What both endpoints render through the chat template."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None  # the last block's, as if marked there
    context_management: ContextManagement | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's


class MessagesRequest(_Conversation, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    cache_salt: str | None = None  # vLLM's
    # kiln's, as on its chat requests: a constraint on the reply's text, and the request's priority.
    structured_outputs: StructuredOutputsParams | None = None
    priority: int = 0


class CountTokensRequest(_Conversation, kw_only=True):
    pass


# -- the reply --------------------------------------------------------------------------------------


class Usage(msgspec.Struct, omit_defaults=True):
    input_tokens: int  # the prompt's tokens not read from the prefix cache, where that is reported
    output_tokens: int
    cache_read_input_tokens: int | UnsetType = UNSET  # --enable-prompt-tokens-details


class TextOut(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ThinkingOut(msgspec.Struct, tag_field="type", tag="thinking", omit_defaults=True):
    thinking: str
    signature: str | UnsetType = UNSET  # random: kiln has nothing to sign, and clients only send it back


class ToolUseOut(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentOut = TextOut | ThinkingOut | ToolUseOut
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesResponse(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage
    context_management: AppliedEdits | UnsetType = UNSET  # where the request asked for edits


class ClearedToolUses(msgspec.Struct, tag_field="type", tag="clear_tool_uses_20250919"):
    cleared_tool_uses: int
    cleared_input_tokens: int


class ClearedThinking(msgspec.Struct, tag_field="type", tag="clear_thinking_20251015"):
    cleared_thinking_turns: int
    cleared_input_tokens: int


class AppliedEdits(msgspec.Struct):
    applied_edits: list[ClearedToolUses | ClearedThinking]


class CountTokensResponse(msgspec.Struct):
    input_tokens: int  # after the request's context edits
    context_management: dict[str, int]  # {"original_input_tokens": before them}


# -- stream events, in their order --------------------------------------------------------------------


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: MessagesResponse


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentOut


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(msgspec.Struct, tag_field="type", tag="signature_delta"):
    signature: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: Usage
    context_management: AppliedEdits | UnsetType = UNSET


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


StreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop
)
