"""Speculative decoding by prompt lookup on copy-heavy chat prompts (a function of Python 3.11's standard
library, to be written out again with one change): output tokens per second, greedy, 256 tokens each
(ignore_eos), at batch 1 (four prompts, one at a time) and batch 16 (all sixteen at once), with drafts and
without; and the share of drafts kept. It runs kiln's LLM or vLLM's (the same API) on the same prompts, so
one script measures both:

    python perf/spec_decode.py --engine kiln --model MODEL_DIR --dtype bfloat16 --spec '{...}'
    VLLM_VENV/bin/python perf/spec_decode.py --engine vllm --model MODEL_DIR --dtype bfloat16 --spec '{...}'

Without --spec: no drafts. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import textwrap
import time
from typing import Any

MAX_TOKENS = 256


def prompts() -> list[str]:
    """Sixteen functions of the standard library (textwrap, json, shlex, heapq, base64), as copy tasks."""
    import base64
    import heapq
    import json.decoder
    import json.encoder
    import shlex

    funcs = [
        f
        for module in (textwrap, json.encoder, json.decoder, shlex, heapq, base64)
        for _, f in sorted(vars(module).items())
        if inspect.isfunction(f) and f.__module__ == module.__name__
    ]
    sources = [inspect.getsource(f) for f in funcs]
    sources = [s for s in sources if 300 < len(s) < 2000][:16]
    assert len(sources) == 16, len(sources)
    return [
        "Rename the function's arguments to snake_case and write the whole function out again:\n\n```python\n"
        + s
        + "```"
        for s in sources
    ]


def build(engine: str, model: str, dtype: str, spec: dict | None) -> Any:
    options: dict[str, Any] = {"dtype": dtype, "max_model_len": 2048, "seed": 0}
    if spec is not None:
        options["speculative_config"] = spec
    if engine == "kiln":
        from kiln import LLM

        return LLM(model, kv_cache_gib=1.0, **options)
    from vllm import LLM

    # Its counters (for the drafts kept) are read only where it speculates.
    return LLM(model, kv_cache_memory_bytes=2**30, disable_log_stats=spec is None, **options)


def drafts(engine: str, llm: Any, spec: dict | None) -> tuple[int, int]:
    """(draft tokens, accepted tokens) so far."""
    if spec is None:
        return 0, 0
    if engine == "kiln":
        d = llm.engine.drafts
        return (d.num_draft_tokens, d.num_accepted_tokens) if d is not None else (0, 0)
    values = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (
        int(values.get("vllm:spec_decode_num_draft_tokens", 0)),
        int(values.get("vllm:spec_decode_num_accepted_tokens", 0)),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["kiln", "vllm"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--spec", type=json.loads, default=None, help="the speculative_config, as JSON")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.engine == "kiln":
        from kiln import SamplingParams
    else:
        from vllm import SamplingParams

    llm = build(args.engine, args.model, args.dtype, args.spec)
    chats = [[{"role": "user", "content": p}] for p in prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.chat(chats[:2], params, use_tqdm=False)  # warm
    result: dict[str, Any] = {"engine": args.engine, "dtype": args.dtype, "spec": args.spec}
    for batch, count in ((1, 4), (16, 16)):
        best = 0.0
        drafted, kept = drafts(args.engine, llm, args.spec)
        for _ in range(args.repeats):
            clock, tokens = time.perf_counter(), 0
            for start in range(0, count, batch):
                outs = llm.chat(chats[start : start + batch], params, use_tqdm=False)
                tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            best = max(best, tokens / (time.perf_counter() - clock))
        d, k = drafts(args.engine, llm, args.spec)
        result[f"batch{batch}_tok_s"] = round(best, 1)
        result[f"batch{batch}_kept"] = round((k - kept) / max(d - drafted, 1), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
