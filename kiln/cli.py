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
from kiln.serve_flags import SERVE_FLAGS

if TYPE_CHECKING:
    from kiln.server_config import ServeConfig

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


def _load_config(args: argparse.Namespace) -> ServeConfig:
    """--config with the SERVE_FLAGS given on the command line laid over it; usage errors name the key."""
    import msgspec

    from kiln.config_file import ConfigError, load_serve_config

    parser: argparse.ArgumentParser = args.parser
    overrides: dict[str, dict] = {}
    given: dict[tuple[str, str], str] = {}  # (section, key) -> the flag that set it
    for flag, (section, key, _) in SERVE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            if (section, key) in given:  # two spellings of one key (--kv-cache-gib, --kv-cache-memory-bytes)
                parser.error(f"{given[section, key]} and {flag} both set {section}.{key}: give one")
            given[section, key] = flag
            overrides.setdefault(section, {})[key] = value
    if getattr(args, "model_tag", None) is not None:
        overrides.setdefault("model", {})["model"] = args.model_tag
    if args.enforce_eager:
        overrides.setdefault("compile", {})["mode"] = "eager"
    try:
        config = load_serve_config(args.config, overrides)
        if config.server.api_key is None and (key := os.environ.get("VLLM_API_KEY")):  # vLLM's fallback
            config = msgspec.structs.replace(
                config, server=msgspec.structs.replace(config.server, api_key=key)
            )
        config.check_supported()
    except ConfigError as e:
        parser.error(str(e))
    except ValueError as e:
        parser.error(f"{e} (from the config file or a flag)")
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    config = _load_config(args)
    if args.trust_remote_code:
        logging.getLogger("kiln").info(
            "--trust-remote-code changes nothing: kiln builds its own architectures and runs no code from "
            "a model folder"
        )
    # Tokenizing runs on one worker thread; the tokenizers library's own thread pool would compete with
    # the engine's OpenMP threads for the cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    clock = time.perf_counter()  # the serving stack's imports (torch, dynamo, transformers, the server)
    from kiln.api.middleware import own
    from kiln.api.server import address, listen, run
    from kiln.engine.tokenizer import chat_template
    from kiln.models.loader import resolve_model
    from kiln.ops.cpu import threads

    imports = time.perf_counter() - clock

    try:
        resolve_model(config.model.model)  # a missing model folder fails here, before the port opens
        if config.model.chat_template is not None:
            chat_template(config.model.chat_template)  # so does a template that is neither file nor Jinja
        threads.resolve(config.backend.cpu_threads_bind, own_thread=True)  # so does a CPU it may not use
        for path in config.server.middleware:  # and middleware that does not import
            own(path)
    except (OSError, ValueError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    s = config.server
    where = address(s.host, s.port, s.uds)
    try:
        sock = listen(where)
    except OSError as e:
        parser.exit(1, f"{parser.prog}: error: cannot listen on {where}: {e.strerror or e}\n")
    return run(config, sock, args.started, imports)


def cmd_run_batch(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    config = _load_config(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import asyncio

    from kiln.api.batch import BatchError, run_batch
    from kiln.models.loader import resolve_model

    try:
        resolve_model(config.model.model)
        return asyncio.run(run_batch(config, args.input_file, args.output_file, args.enable_metrics))
    except (OSError, ValueError, BatchError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")


def cmd_warmup(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    config = _load_config(args)
    if args.import_file is not None:
        config.compile.cache_file = str(args.import_file)
    from kiln.compile.cache import CacheError
    from kiln.compile.reports import compile_counters
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


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    for flag, (_, _, kwargs) in SERVE_FLAGS.items():
        options = dict(kwargs)
        parser.add_argument(flag, *options.pop("aliases", ()), default=None, **options)


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
    # vLLM's `vllm serve [model_tag] [options]`: the model folder may come first, as --model.
    serve.add_argument("model_tag", nargs="?", default=None, help="model folder (wins over --model)")
    _add_serve_flags(serve)
    serve.add_argument("--enforce-eager", action="store_true", help="run the model eagerly (no compile)")
    serve.add_argument(
        "--trust-remote-code", action="store_true", help="vLLM's; kiln runs no code from a model folder"
    )
    serve.set_defaults(run=cmd_serve, parser=serve)

    batch = commands.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) through the API and write the results (vLLM's)"
    )
    batch.add_argument("-i", "--input-file", required=True, metavar="INPUT", help="a path or http(s) URL")
    batch.add_argument("-o", "--output-file", required=True, metavar="OUTPUT", help="a path or http(s) URL")
    batch.add_argument("--config", type=Path, help="YAML config, as for kiln serve")
    batch.add_argument("model_tag", nargs="?", default=None, help="model folder (wins over --model)")
    _add_serve_flags(batch)
    batch.add_argument("--enforce-eager", action="store_true", help="run the model eagerly (no compile)")
    batch.add_argument("--enable-metrics", action="store_true", help="Prometheus metrics on --host, --port")
    batch.set_defaults(run=cmd_run_batch, parser=batch)

    warmup = commands.add_parser(
        "warmup", help="build every compiled bucket into the compile cache ahead of serving"
    )
    warmup.add_argument("--config", type=Path, help="YAML config, as for kiln serve")
    _add_serve_flags(warmup)
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
