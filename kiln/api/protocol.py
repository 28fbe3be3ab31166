"""Request bodies of the OpenAI API (plus vLLM's extra fields), as msgspec Structs. They refuse unknown
fields and wrong types: a field kiln does not implement is a 400 that names it, never silence. The
responses are in kiln.api.responses."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

import msgspec

from kiln.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


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
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural_tag: xgrammar's current form (`format`), or its older one (`structures`, `triggers`)
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stream_interval: Annotated[int, msgspec.Meta(ge=1)] | None = None  # tokens a chunk gathers (vLLM's)
    user: str | None = None  # informational, as are metadata and session_id
    session_id: str | None = None
    metadata: dict[str, str] | None = None
    response_format: ResponseFormat | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # null: left (keep the prompt's end)
    repetition_detection: RepetitionDetectionParams | None = None
    thinking_token_budget: int | None = None  # with a reasoning parser; -1: no limit
    prompt_logprobs: int | None = None
    return_token_ids: bool = False  # token ids beside the text
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:{id}"
    priority: int = 0  # smaller first, under --scheduling-policy priority (the X-Vllm-Priority header wins)
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    request_id: str | None = None  # the response's id after its prefix (the X-Request-Id header wins)
    use_beam_search: bool = False  # n beams, the best n returned (kiln.api.beam_search)
    length_penalty: float = 1.0  # beam scores: cumulative logprob / length ** length_penalty


class CompletionRequest(_SamplingRequest, kw_only=True):
    # One string, strings, token ids, or lists of ids; may be left out (or "") where prompt_embeds are given.
    prompt: str | list[str | int | list[int]] | None = None
    # vLLM's (--enable-prompt-embeds): base64 torch.save'd (tokens, hidden_size) tensors, each a prompt of
    # its own, before the prompts of `prompt`.
    prompt_embeds: bytes | list[bytes] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) on a text prompt
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: str  # "text", or vLLM's "prompt_embeds" (--enable-prompt-embeds)
    text: str | None = None
    data: bytes | None = None  # a prompt_embeds part's: base64 of a torch.save'd (tokens, hidden_size) tensor


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
    # An assistant's earlier thinking, as a reply with a reasoning parser gives it (vLLM's older name too),
    # for templates that show it again (Qwen3's reads reasoning_content).
    reasoning: str | None = None
    reasoning_content: str | None = None


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
    reasoning_effort: ReasoningEffort | None  # the template's reasoning_effort (and enable_thinking)
    documents: list[dict[str, str]] | None  # for a template that shows them (RAG)
    chat_template: str | None  # the request's own (server.trust_request_chat_template)


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
    chat_template: str | None = None
    reasoning_effort: ReasoningEffort | None = None
    return_prompt_text: bool = False  # the prompt the model was given, as text
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
    chat_template: str | None = None
    reasoning_effort: ReasoningEffort | None = None
    documents: list[dict[str, str]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class _PooledInputRequest(_Strict):
    """A pooling request's inputs (vLLM's): text or token ids in `input`, or one conversation in
    `messages` (through the chat template)."""

    model: str | None = None
    input: str | list[str | int | list[int]] | None = None
    messages: list[ChatMessage] | None = None
    user: str | None = None
    use_activation: bool | None = None  # unset: the pooler's (normalized, or class probabilities)
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # -1: max_model_len
    truncation_side: Literal["left", "right"] | None = None  # unset: the tokenizer's
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    add_special_tokens: bool | None = None  # unset: True for input, False for messages (vLLM's)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    reasoning_effort: ReasoningEffort | None = None
    documents: list[dict[str, str]] | None = None


class EmbeddingRequest(_PooledInputRequest, kw_only=True):
    """OpenAI's /v1/embeddings, with vLLM's extras."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"  # base64's
    endianness: Literal["native", "big", "little"] = "native"  # base64's


class ClassificationRequest(_PooledInputRequest, kw_only=True):
    """vLLM's /classify: each input's class probabilities."""


class PoolingRequest(EmbeddingRequest, kw_only=True):
    """vLLM's /pooling: each input's pooled output as the model's task makes it (an embedding, or class
    probabilities); `task` may name that task."""

    task: Literal["embed", "classify", "token_embed", "token_classify", "plugin"] | None = None


class _ScoringRequest(_Strict):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # each text's
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    max_tokens_per_query: Annotated[int, msgspec.Meta(ge=0)] = 0  # a query's text cut to this many tokens
    max_tokens_per_doc: Annotated[int, msgspec.Meta(ge=0)] = 0


class ScoreRequest(_ScoringRequest):
    """vLLM's /score: one pair of fields, each a text or a list (1:1, 1:N or N:N)."""

    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None  # documents' other name
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None


class RerankRequest(_ScoringRequest, kw_only=True):
    """vLLM's /rerank (Jina's and Cohere's shape): the documents by relevance to the query."""

    query: str
    documents: str | list[str]
    top_n: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: all
