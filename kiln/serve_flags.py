"""`kiln serve`'s flags: vLLM's names for the config keys they set."""

from __future__ import annotations

import argparse
import json
from typing import get_args

from kiln.config import KvCacheDtype, MaxLoraRank
from kiln.flag_types import gib, human_readable_int, lora_module

# vLLM's flag -> (config section, key, argparse options; "aliases": vLLM's short forms). Flags left unset
# keep the config file's value.
SERVE_FLAGS: dict[str, tuple[str, str, dict]] = {
    "--model": ("model", "model", {"help": "model folder, or 'default' (SmolLM2-135M-Instruct)"}),
    "--served-model-name": ("server", "served_model_name", {"nargs": "+", "metavar": "NAME"}),
    "--chat-template": ("model", "chat_template", {"metavar": "FILE_OR_TEMPLATE"}),
    "--host": ("server", "host", {}),
    "--port": ("server", "port", {"type": int}),
    "--uds": ("server", "uds", {"metavar": "PATH", "help": "serve on a Unix domain socket, not host:port"}),
    "--api-key": (
        "server",
        "api_key",
        {"nargs": "+", "metavar": "KEY", "help": "require 'Authorization: Bearer KEY' on /v1/* (any one)"},
    ),
    "--allowed-origins": ("server", "allowed_origins", {"type": json.loads, "metavar": "JSON"}),
    "--allowed-methods": ("server", "allowed_methods", {"type": json.loads, "metavar": "JSON"}),
    "--allowed-headers": ("server", "allowed_headers", {"type": json.loads, "metavar": "JSON"}),
    "--allow-credentials": ("server", "allow_credentials", {"action": "store_true"}),
    "--disable-access-log-for-endpoints": (
        "server",
        "disable_access_log_for_endpoints",
        {"type": lambda s: s.split(","), "metavar": "PATHS", "help": "e.g. /health,/metrics"},
    ),
    "--max-model-len": ("model", "max_model_len", {"type": int}),
    "--max-num-seqs": ("scheduler", "max_num_seqs", {"type": int}),
    "--max-num-batched-tokens": ("scheduler", "max_num_batched_tokens", {"type": human_readable_int}),
    "--max-num-queued-reqs": ("scheduler", "max_num_queued_reqs", {"type": int, "help": "503 beyond"}),
    "--max-num-queued-tokens": (
        "scheduler",
        "max_num_queued_tokens",
        {"type": human_readable_int, "help": "prompt tokens awaiting prefill; 503 beyond"},
    ),
    "--long-prefill-token-threshold": ("scheduler", "long_prefill_token_threshold", {"type": int}),
    "--enable-chunked-prefill": (
        "scheduler",
        "enable_chunked_prefill",
        {"action": argparse.BooleanOptionalAction, "help": "off: each prompt prefilled in one step"},
    ),
    "--async-scheduling": (
        "scheduler",
        "async_scheduling",
        {"action": argparse.BooleanOptionalAction, "help": "schedule a step while the last runs (CUDA)"},
    ),
    "--scheduling-policy": ("scheduler", "policy", {"choices": ["fcfs", "priority"]}),
    "--block-size": ("cache", "block_size", {"type": int}),
    "--kv-cache-gib": ("cache", "kv_cache_gib", {"type": float}),
    "--kv-cache-memory-bytes": (
        "cache",
        "kv_cache_gib",
        {"type": gib, "metavar": "BYTES", "help": "e.g. 4G"},
    ),
    "--num-gpu-blocks-override": ("cache", "num_gpu_blocks_override", {"type": int}),
    "--kv-cache-dtype": ("cache", "kv_cache_dtype", {"choices": list(get_args(KvCacheDtype))}),
    "--dtype": ("model", "dtype", {"choices": ["auto", "float32", "bfloat16", "float16"]}),
    "--device": ("model", "device", {}),
    "--seed": ("model", "seed", {"type": int}),
    "--max-logprobs": ("model", "max_logprobs", {"type": int, "help": "the most logprobs a request may ask"}),
    "--generation-config": ("model", "generation_config", {"help": "auto, vllm, or a folder"}),
    "--override-generation-config": (
        "model",
        "override_generation_config",
        {"type": json.loads, "metavar": "JSON", "help": "laid over the generation config"},
    ),
    "--shutdown-timeout": (
        "server",
        "drain_timeout",
        {"type": float, "help": "seconds SIGTERM waits for requests in flight (0: abort them)"},
    ),
    "--gpu-memory-utilization": ("cache", "gpu_memory_utilization", {"type": float}),
    "--tensor-parallel-size": ("parallel", "tensor_parallel_size", {"type": int, "aliases": ("-tp",)}),
    "--pipeline-parallel-size": ("parallel", "pipeline_parallel_size", {"type": int, "aliases": ("-pp",)}),
    "--data-parallel-size": ("parallel", "data_parallel_size", {"type": int, "aliases": ("-dp",)}),
    "--hf-overrides": (
        "model",
        "hf_overrides",
        {
            "type": json.loads,
            "metavar": "JSON",
            "help": "laid over config.json, e.g. '{\"rope_theta\": 1e6}'",
        },
    ),
    "--load-format": (
        "model",
        "load_format",
        {"choices": ["auto", "safetensors", "dummy"], "help": "dummy: random weights, for measuring speed"},
    ),
    "--compile-mode": ("compile", "mode", {"choices": ["auto", "eager", "compiled", "cudagraph"]}),
    "--cudagraph-capture-sizes": ("compile", "decode_sizes", {"type": int, "nargs": "+", "metavar": "N"}),
    "--max-cudagraph-capture-size": ("compile", "max_decode_size", {"type": int}),
    "--deterministic": ("backend", "deterministic", {"action": "store_true", "help": "batch-invariant CUDA"}),
    "--cpu-threads-bind": ("backend", "cpu_threads_bind", {"help": "auto, nobind, or CPUs such as 0-3,8"}),
    "--compile-cache": ("compile", "cache_file", {"metavar": "FILE", "help": "a kiln warmup --export file"}),
    "--max-n-sequences": ("server", "max_n_sequences", {"type": int, "help": "largest n a request may ask"}),
    "--max-stop-strings": ("server", "max_stop_strings", {"type": int}),
    "--max-completion-prompts": ("server", "max_completion_prompts", {"type": int}),
    "--loop-nice": ("server", "loop_nice", {"type": int, "help": "event loop's nice above the engine's"}),
    "--max-prompt-chars": ("server", "max_prompt_chars", {"type": int, "help": "checked before tokenizing"}),
    "--enable-auto-tool-choice": (
        "server",
        "enable_auto_tool_choice",
        {"action": "store_true", "help": 'tool_choice "auto", parsed by --tool-call-parser'},
    ),
    "--tool-call-parser": (
        "server",
        "tool_call_parser",
        {"choices": ["hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"]},
    ),
    "--logprobs-mode": (
        "model",
        "logprobs_mode",
        {"choices": ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]},
    ),
    "--structured-outputs-config": (
        "model",
        "structured_outputs_config",
        {"type": json.loads, "metavar": "JSON", "help": 'e.g. {"enable_in_reasoning": true}'},
    ),
    "--reasoning-parser": ("model", "reasoning_parser", {"choices": ["deepseek_r1", "qwen3"]}),
    "--enable-lora": (
        "lora",
        "enable_lora",
        {"action": argparse.BooleanOptionalAction, "help": "serve LoRA adapters"},
    ),
    "--max-loras": ("lora", "max_loras", {"type": int, "help": "the most adapters one step runs"}),
    "--max-lora-rank": ("lora", "max_lora_rank", {"type": int, "choices": get_args(MaxLoraRank)}),
    "--max-cpu-loras": ("lora", "max_cpu_loras", {"type": int, "help": "adapters kept on the host"}),
    "--lora-dtype": ("lora", "lora_dtype", {"choices": ["auto", "float32", "bfloat16", "float16"]}),
    "--fully-sharded-loras": ("lora", "fully_sharded_loras", {"action": "store_true"}),
    "--speculative-config": (
        "scheduler",
        "speculative_config",
        {
            "type": json.loads,
            "metavar": "JSON",
            "aliases": ("-sc",),
            "help": '{"method": "ngram", "num_speculative_tokens": 4}',
        },
    ),
    "--lora-modules": (
        "server",
        "lora_modules",
        {"type": lora_module, "nargs": "+", "metavar": "NAME=PATH", "help": "adapters to serve, or JSON"},
    ),
    "--runner": (
        "model",
        "runner",
        {"choices": ["auto", "generate", "pooling"], "help": "pooling: embeddings"},
    ),
    "--convert": (
        "model",
        "convert",
        {"choices": ["auto", "none", "embed"], "help": "embed: as --runner pooling"},
    ),
    "--pooler-config": (
        "model",
        "pooler_config",
        {"type": json.loads, "metavar": "JSON", "help": 'e.g. {"pooling_type": "MEAN"}'},
    ),
    "--enable-request-id-headers": (
        "server",
        "enable_request_id_headers",
        {"action": "store_true", "help": "an X-Request-Id header on every response"},
    ),
    "--stream-interval": ("server", "stream_interval", {"type": int, "help": "tokens per streamed chunk"}),
    "--enable-log-requests": (
        "server",
        "enable_log_requests",
        {"action": "store_true", "help": "log each request's prompt and sampling params"},
    ),
    "--disable-log-stats": (
        "server",
        "disable_log_stats",
        {"action": "store_true", "help": "no periodic throughput and queue line"},
    ),
    "--enable-log-outputs": (
        "server",
        "enable_log_outputs",
        {"action": "store_true", "help": "log each finished choice's text and token ids"},
    ),
    "--max-log-len": ("server", "max_log_len", {"type": int, "help": "prompt characters and ids logged"}),
    "--enable-prompt-tokens-details": (
        "server",
        "enable_prompt_tokens_details",
        {"action": "store_true", "help": "usage.prompt_tokens_details.cached_tokens"},
    ),
    "--enable-per-request-metrics": (
        "server",
        "enable_per_request_metrics",
        {"action": "store_true", "help": "each reply's timings as `metrics`"},
    ),
    "--tokenizer": ("model", "tokenizer", {"help": "a tokenizer folder (default: the model's)"}),
    "--enable-prompt-embeds": ("model", "enable_prompt_embeds", {"action": "store_true"}),
    "--disable-sliding-window": (
        "model",
        "disable_sliding_window",
        {"action": "store_true", "help": "full attention, the context capped at the window"},
    ),
    "--skip-tokenizer-init": (
        "model",
        "skip_tokenizer_init",
        {"action": argparse.BooleanOptionalAction, "help": "token ids in, token ids out: no tokenizer"},
    ),
    "--enable-prefix-caching": ("cache", "enable_prefix_caching", {"action": argparse.BooleanOptionalAction}),
    "--disable-uvicorn-access-log": ("server", "disable_uvicorn_access_log", {"action": "store_true"}),
    "--ssl-certfile": ("server", "ssl_certfile", {"metavar": "FILE"}),
    "--ssl-keyfile": ("server", "ssl_keyfile", {"metavar": "FILE"}),
    "--ssl-ca-certs": ("server", "ssl_ca_certs", {"metavar": "FILE"}),
    "--ssl-cert-reqs": ("server", "ssl_cert_reqs", {"type": int, "help": "2: clients need a certificate"}),
    "--response-role": ("server", "response_role", {"help": "the role of chat replies"}),
    "--return-tokens-as-token-ids": ("server", "return_tokens_as_token_ids", {"action": "store_true"}),
    "--enable-force-include-usage": ("server", "enable_force_include_usage", {"action": "store_true"}),
    "--default-chat-template-kwargs": (
        "server",
        "default_chat_template_kwargs",
        {"type": json.loads, "metavar": "JSON", "help": 'e.g. {"enable_thinking": false}'},
    ),
    "--chat-template-content-format": (
        "server",
        "chat_template_content_format",
        {"choices": ["auto", "string", "openai"], "help": "messages' content as text or a list of parts"},
    ),
    "--trust-request-chat-template": ("server", "trust_request_chat_template", {"action": "store_true"}),
    "--enable-server-load-tracking": ("server", "enable_server_load_tracking", {"action": "store_true"}),
    "--sse-keep-alive-interval": (
        "server",
        "sse_keep_alive_interval",
        {"type": int, "help": "a ': keep-alive' comment after this many idle seconds of a stream"},
    ),
    "--middleware": (
        "server",
        "middleware",
        {"action": "append", "metavar": "IMPORT.PATH", "help": "an ASGI middleware class or async function"},
    ),
    "--root-path": ("server", "root_path", {"help": "the path prefix a routing proxy adds"}),
    "--uvicorn-log-level": (
        "server",
        "uvicorn_log_level",
        {"choices": ["critical", "error", "warning", "info", "debug", "trace"], "help": "the HTTP server's"},
    ),
    "--log-error-stack": ("server", "log_error_stack", {"action": "store_true"}),
    "--enable-tokenizer-info-endpoint": (
        "server",
        "enable_tokenizer_info_endpoint",
        {"action": "store_true"},
    ),
    "--anthropic-disabled-thinking-effort": (
        "server",
        "anthropic_disabled_thinking_effort",
        {"choices": ["auto", "none", "low", "medium", "high", "xhigh", "max"], "help": "/v1/messages"},
    ),
    "--exclude-tools-when-tool-choice-none": (
        "server",
        "exclude_tools_when_tool_choice_none",
        {"action": "store_true"},
    ),
}
