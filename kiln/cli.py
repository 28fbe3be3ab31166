"""The `kiln` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.perf.cli import add_perf_parser

if TYPE_CHECKING:
    from kiln.config import ServeConfig

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def cmd_convert(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    if not args.src.is_file():
        parser.error(f"GGUF file not found: {args.src}")
    # Imported here so that `kiln --help` does not pay for torch and transformers.
    from kiln.models.convert import convert_gguf

    try:
        convert_gguf(args.src, args.dest, progress=not args.no_progress)
    except (OSError, ValueError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kiln import LLM, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype)
        if args.chat:
            convs = [[{"role": "user", "content": p}] for p in args.prompts]
            outputs = llm.chat(convs, params, use_tqdm=False)  # type: ignore[arg-type]
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except (OSError, ValueError) as e:
        args.parser.exit(1, f"{args.parser.prog}: error: {e}\n")
    for out in outputs:
        sys.stdout.write(out.outputs[0].text + "\n")
    return 0


# vLLM's flag -> (config section, key). Flags left unset keep the config file's value.
SERVE_FLAGS: dict[str, tuple[str, str, dict]] = {
    "--model": ("model", "model", {"help": "model folder, or 'default' (SmolLM2-135M-Instruct)"}),
    "--served-model-name": ("server", "served_model_name", {"nargs": "+", "metavar": "NAME"}),
    "--chat-template": ("model", "chat_template", {"metavar": "FILE_OR_TEMPLATE"}),
    "--host": ("server", "host", {}),
    "--port": ("server", "port", {"type": int}),
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
    "--max-num-batched-tokens": ("scheduler", "max_num_batched_tokens", {"type": int}),
    "--long-prefill-token-threshold": ("scheduler", "long_prefill_token_threshold", {"type": int}),
    "--async-scheduling": (
        "scheduler",
        "async_scheduling",
        {"action": argparse.BooleanOptionalAction, "help": "schedule a step while the last runs (CUDA)"},
    ),
    "--scheduling-policy": ("scheduler", "policy", {"choices": ["fcfs", "priority"]}),
    "--block-size": ("cache", "block_size", {"type": int}),
    "--kv-cache-gib": ("cache", "kv_cache_gib", {"type": float}),
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
    "--drain-timeout": ("server", "drain_timeout", {"type": float, "help": "seconds SIGTERM waits"}),
    "--gpu-memory-utilization": ("cache", "gpu_memory_utilization", {"type": float}),
    "--tensor-parallel-size": ("parallel", "tensor_parallel_size", {"type": int}),
    "--compile-mode": ("compile", "mode", {"choices": ["auto", "eager", "compiled", "cudagraph"]}),
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
    "--reasoning-parser": ("model", "reasoning_parser", {"choices": ["deepseek_r1", "qwen3"]}),
    "--runner": (
        "model",
        "runner",
        {"choices": ["auto", "generate", "pooling"], "help": "pooling: embeddings"},
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
}


def _load_config(args: argparse.Namespace) -> ServeConfig:
    """--config with the SERVE_FLAGS given on the command line laid over it; usage errors name the key."""
    from kiln.config import ConfigError, load_serve_config

    parser: argparse.ArgumentParser = args.parser
    overrides: dict[str, dict] = {}
    for flag, (section, key, _) in SERVE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    if args.enforce_eager:
        overrides.setdefault("compile", {})["mode"] = "eager"
    try:
        config = load_serve_config(args.config, overrides)
        config.check_supported()
    except ConfigError as e:
        parser.error(str(e))
    except ValueError as e:
        parser.error(f"{e} (from the config file or a flag)")
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    config = _load_config(args)
    # Tokenizing runs on one worker thread; the tokenizers library's own thread pool would compete with
    # the engine's OpenMP threads for the cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    clock = time.perf_counter()  # the serving stack's imports (torch, dynamo, transformers, the server)
    from kiln.api.server import listen, run
    from kiln.engine.tokenizer import chat_template
    from kiln.models.loader import resolve_model
    from kiln.ops.cpu import threads

    imports = time.perf_counter() - clock

    try:
        resolve_model(config.model.model)  # a missing model folder fails here, before the port opens
        if config.model.chat_template is not None:
            chat_template(config.model.chat_template)  # so does a template that is neither file nor Jinja
        threads.resolve(config.backend.cpu_threads_bind, own_thread=True)  # so does a CPU it may not use
    except (OSError, ValueError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    s = config.server
    try:
        sock = listen(s.host, s.port)
    except OSError as e:
        parser.exit(1, f"{parser.prog}: error: cannot listen on {s.host}:{s.port}: {e.strerror or e}\n")
    return run(config, sock, args.started, imports)


def cmd_warmup(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    config = _load_config(args)
    if args.import_file is not None:
        config.compile.cache_file = str(args.import_file)
    from kiln.compile.cache import CacheError
    from kiln.compile.lowering import compile_counters
    from kiln.engine.engine import LLMEngine

    try:
        engine = LLMEngine(config)
        reports = engine.warmup(progress=not args.no_progress)
        if args.export is not None:
            engine.compile_cache.export(args.export)
    except (OSError, ValueError, CacheError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    rows = [(r.bucket, r.covers, r.source, f"{r.seconds:.2f}") for r in reports]
    rows.append(("total", "", "", f"{sum(r.seconds for r in reports):.2f}"))
    header = ("bucket", "covers", "source", "seconds")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")
    sys.stdout.write(f"compile cache: {engine.compile_cache.dir}\n")
    if args.export is not None:
        sys.stdout.write(f"exported to {args.export}\n")
    if args.json is not None:
        report = {"buckets": [r.as_dict() for r in reports], "counters": compile_counters()}
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="An LLM serving stack.")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    convert = commands.add_parser(
        "convert", help="convert a llama GGUF file into a Hugging Face model folder"
    )
    convert.add_argument("src", type=Path, metavar="SRC.gguf")
    convert.add_argument("dest", type=Path, metavar="DEST", help="folder to create; must not hold files")
    convert.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    convert.set_defaults(run=cmd_convert, parser=convert)

    generate = commands.add_parser("generate", help="generate completions offline and print them")
    generate.add_argument("prompts", nargs="+", metavar="PROMPT")
    generate.add_argument("--model", default="default", help="model folder, or 'default' (SmolLM2-135M)")
    generate.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    generate.set_defaults(run=cmd_generate, parser=generate)

    serve = commands.add_parser("serve", help="serve an OpenAI-compatible API (default: 127.0.0.1:8000)")
    serve.add_argument("--config", type=Path, help="YAML config (see configs/); flags override it")
    for flag, (_, _, kwargs) in SERVE_FLAGS.items():
        serve.add_argument(flag, default=None, **kwargs)
    serve.add_argument("--enforce-eager", action="store_true", help="run the model eagerly (no compile)")
    serve.set_defaults(run=cmd_serve, parser=serve)

    warmup = commands.add_parser(
        "warmup", help="build every compiled bucket into the compile cache ahead of serving"
    )
    warmup.add_argument("--config", type=Path, help="YAML config, as for kiln serve")
    for flag, (_, _, kwargs) in SERVE_FLAGS.items():
        warmup.add_argument(flag, default=None, **kwargs)
    warmup.add_argument("--enforce-eager", action="store_true", help="warm the eager mode's kernels only")
    warmup.add_argument(
        "--export", type=Path, metavar="FILE", help="also write the entry to one portable file"
    )
    warmup.add_argument(
        "--import", dest="import_file", type=Path, metavar="FILE", help="install an exported file first"
    )
    warmup.add_argument("--json", type=Path, metavar="FILE", help="write the per-bucket table as JSON")
    warmup.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    warmup.set_defaults(run=cmd_warmup, parser=warmup)

    add_perf_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.started = started
        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return args.run(args)
    except SystemExit as e:
        # argparse exits on bad usage (and --help); return its status so callers always get an int.
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
