"""`kiln serve`'s configuration: the engine's sections plus the HTTP server's."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kiln.config import EngineConfig
from kiln.config_section import Section


class LoraModule(Section):
    """One adapter served under its own name (vLLM's --lora-modules name=path, or its JSON form)."""

    name: str
    path: str
    base_model_name: str | None = None


class ServerConfig(Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    uds: str | None = None  # vLLM's --uds: serve on this Unix domain socket; host and port are then unused
    api_key: str | list[str] | None = None  # when set, /v1/* needs "Authorization: Bearer <one of them>"
    served_model_name: str | list[str] | None = None  # the model's names, the first reported; null: its own
    # Seconds SIGTERM waits for requests in flight, refusing new ones (--shutdown-timeout; 0 aborts them).
    drain_timeout: Annotated[float, Meta(ge=0)] = 30.0
    max_request_bytes: Annotated[int, Meta(ge=1024)] = 16 * 2**20  # larger bodies get 413
    # What one request may ask for; over a limit is a 400 naming it. vLLM's names (its VLLM_MAX_* variables).
    max_n_sequences: Annotated[int, Meta(ge=1)] = 128  # `n`; OpenAI's own cap
    max_stop_strings: Annotated[int, Meta(ge=0)] = 4  # entries of `stop`, as OpenAI and vLLM
    max_completion_prompts: Annotated[int, Meta(ge=1)] = 1024  # prompts in one /v1/completions request
    # Characters of prompt text, checked before tokenizing. null: max_model_len tokens of the tokenizer's
    # longest token, twice over (normalizers may shorten text), so no prompt that fits is refused.
    max_prompt_chars: Annotated[int, Meta(ge=1)] | None = None
    # The event loop's nice value above the engine's (Linux): bulk work such as receiving large bodies
    # yields the cores to the engine's threads. 0 leaves both equal.
    loop_nice: Annotated[int, Meta(ge=0, le=19)] = 5
    # tool_choice "auto" (the default when a request gives tools): the model's text parsed into calls by
    # tool_call_parser, the format its chat template teaches. Off, "auto" is a 400, as in vLLM.
    enable_auto_tool_choice: bool = False
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"] | None = None
    # vLLM's: every response carries an X-Request-Id header, the request's own or a random one.
    enable_request_id_headers: bool = False
    # vLLM's CORS: browsers on these origins may call the server (none by default, as vLLM; "*": any).
    allowed_origins: list[str] = msgspec.field(default_factory=list)
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # Paths whose requests the access log leaves out, e.g. ["/health", "/metrics"] (vLLM's
    # --disable-access-log-for-endpoints).
    disable_access_log_for_endpoints: list[str] = msgspec.field(default_factory=list)
    # vLLM's --stream-interval: a streamed choice's tokens gathered into chunks of this many (its first and
    # last chunks go at once); fewer, larger chunks cost the server and the client less. A request's
    # stream_interval may raise it.
    stream_interval: Annotated[int, Meta(ge=1)] = 1
    # vLLM's: each usage also gives prompt_tokens_details.cached_tokens, the prompt tokens served from the
    # prefix cache.
    enable_prompt_tokens_details: bool = False
    # vLLM's --enable-per-request-metrics: a one-prompt, n = 1 completion or chat reply carries `metrics`, its
    # timings (in a stream, on the usage chunk).
    enable_per_request_metrics: bool = False
    # vLLM's --enable-log-requests: each request's prompt and sampling params, logged as it is queued;
    # --max-log-len cuts the prompt's text and ids to that many (null: whole).
    enable_log_requests: bool = False
    max_log_len: Annotated[int, Meta(ge=0)] | None = None
    # vLLM's --enable-log-outputs: each finished choice's text, token ids and finish reason (cut likewise).
    enable_log_outputs: bool = False
    # vLLM's engine line every log_stats_interval seconds (throughput, queue, KV cache, prefix-cache hit
    # rate), at INFO while there is work; --disable-log-stats turns it off.
    disable_log_stats: bool = False
    log_stats_interval: Annotated[float, Meta(gt=0)] = 10.0
    disable_uvicorn_access_log: bool = False  # vLLM's name: no access log at all
    # HTTPS (vLLM's --ssl-*): the server's certificate chain and key; with ssl_ca_certs and ssl_cert_reqs 2
    # (ssl.CERT_REQUIRED), clients must show a certificate that CA signed.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: Annotated[int, Meta(ge=0, le=2)] = 0
    # Server-wide defaults for request fields, as vLLM's flags of the same names: the role of chat replies,
    # logprobs' tokens as "token_id:{id}", usage in every stream, and chat_template_kwargs under a request's.
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    default_chat_template_kwargs: dict[str, Any] | None = None
    # A request's own chat_template is refused unless this is set: a template is code the server runs.
    trust_request_chat_template: bool = False
    # vLLM's operations flags. GET /load gives the generation and pooling requests in flight.
    enable_server_load_tracking: bool = False
    # A chat or completions stream idle this many seconds (queued, prefilling, between tokens) gets a
    # ": keep-alive" comment, so proxies with read timeouts keep it open; 0: never.
    sse_keep_alive_interval: Annotated[int, Meta(ge=0)] = 0
    root_path: str | None = None  # the prefix a path-routing proxy puts before kiln's paths
    # The HTTP server's access and error logs (vLLM's --uvicorn-log-level; null: as kiln's --log-level).
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] | None = None
    log_error_stack: bool = False  # log each error response with its traceback
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info: the tokenizer's config, template too
    # tool_choice "none" leaves the tools out of the prompt (else the template shows them, as vLLM's default).
    exclude_tools_when_tool_choice_none: bool = False
    # The reasoning_effort of a /v1/messages request's thinking {"type": "disabled"} (vLLM's flag): "none"
    # turns thinking off where the template can; "auto" takes "low" where it cannot (it renders "none" as
    # a thinking effort, or refuses it).
    anthropic_disabled_thinking_effort: Literal["auto", "none", "low", "medium", "high", "xhigh", "max"] = (
        "auto"
    )
    # How a message's content reaches the chat template (vLLM's --chat-template-content-format): "string",
    # its text parts joined by newlines; "openai", the list of parts; auto: whichever the template reads.
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    # vLLM's --middleware: import paths of ASGI middleware classes or async (request, call_next) functions,
    # run outermost, in order.
    middleware: list[str] = msgspec.field(default_factory=list)
    # LoRA adapters served from the start, each under its name (lora.enable_lora must be on).
    lora_modules: list[LoraModule] = msgspec.field(default_factory=list)

    @property
    def api_keys(self) -> list[str]:
        return [self.api_key] if isinstance(self.api_key, str) else self.api_key or []

    def __post_init__(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("server.ssl_certfile and server.ssl_keyfile go together")
        root = self.root_path
        if root is not None and (not root.startswith("/") or root.endswith("/")):
            raise ValueError(f"server.root_path must start with / and not end with one, not {root!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "server.enable_auto_tool_choice needs server.tool_call_parser "
                "(hermes, llama3_json, mistral, qwen3_coder or pythonic)"
            )


class ServeConfig(EngineConfig):
    """What `kiln serve` runs: the engine sections plus the HTTP server."""

    server: ServerConfig = msgspec.field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        if self.server.lora_modules and not self.lora.enable_lora:
            raise ValueError("server.lora_modules needs lora.enable_lora (--enable-lora)")
