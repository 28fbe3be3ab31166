"""Grammar compile time with xgrammar's rule cache off and on, as kiln's grammar thread compiles (one thread,
the default model's tokenizer), a fresh compiler per schema: each schema, then the same schema under new
field names (what the cache shares across grammars).

    .venv/bin/python perf/grammar_compile.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import xgrammar as xgr
import yaml
from transformers import AutoTokenizer

from kiln.engine.grammar import COMPILER_CACHE_BYTES
from kiln.models.convert import default_model_dir


def fields(prefix: str, patterns: list[str]) -> dict:
    props = {f"{prefix}{i}": {"type": "string", "pattern": p} for i, p in enumerate(patterns)}
    return {"type": "object", "properties": props, "required": list(props)}


def people(prefix: str) -> dict:
    spec = yaml.safe_load(Path("configs/perf/structured-c16.yaml").read_text())
    schema = spec["extra_body"]["response_format"]["json_schema"]["schema"]
    items = schema["items"]
    items["properties"] = {f"{prefix}{k}": v for k, v in items["properties"].items()}
    items["required"] = [f"{prefix}{k}" for k in items["required"]]
    return schema


SCHEMAS = {
    "40 fields, one pattern": lambda p: fields(p, ["[a-z]{3,40}[0-9]{2,9}"] * 40),
    "40 fields, 40 patterns": lambda p: fields(p, [f"[a-z]{{3,{40 + i}}}[0-9]{{2,9}}" for i in range(40)]),
    "structured-c16's people": people,
}


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152)
    print("| schema | cache | first (s) | same, new names (s) |\n|---|---|---|---|")
    for name, make in SCHEMAS.items():
        for cached in (False, True):
            compiler = xgr.GrammarCompiler(
                info, max_threads=1, cache_enabled=cached, cache_limit_bytes=COMPILER_CACHE_BYTES
            )
            seconds = []
            for prefix in ("a", "b"):
                grammar = xgr.Grammar.from_json_schema(json.dumps(make(prefix)))
                clock = time.perf_counter()
                compiler.compile_grammar(grammar)
                seconds.append(time.perf_counter() - clock)
            print(
                f"| {name} | {'on' if cached else 'off'} | {seconds[0]:.3f} | {seconds[1]:.3f} |", flush=True
            )


if __name__ == "__main__":
    main()
