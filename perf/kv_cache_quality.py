"""What an fp8 KV cache does to the default model's predictions, for each --kv-cache-dtype:

- perplexity of a long English text (default: the GPL-3's 35 kB), teacher-forced in windows of 2,000
  tokens, from the prompt logprobs;
- greedy agreement with `auto`: kiln's builtin prompts as chat messages, 64 tokens each; the share of
  replies identical to auto's, and the mean position of the first differing token in the others.

    python perf/kv_cache_quality.py [--text FILE] [--dtype auto] [--dtypes auto fp8_e4m3 ...] [--json OUT]

--dtype is the model's (auto: bfloat16 on a CPU with native bfloat16); --dtypes the caches', the first the
one the others' replies are compared with.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from importlib import resources
from pathlib import Path

from kiln import LLM, SamplingParams

WINDOW = 2000


def perplexity(llm: LLM, text: str) -> tuple[float, int]:
    ids = llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"]
    windows = [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW) if len(ids) - i > 1]
    outputs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, count = 0.0, 0
    for window, out in zip(windows, outputs, strict=True):
        for token, position in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            nll -= position[token].logprob
            count += 1
    return math.exp(nll / count), count


def greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--dtypes", nargs="+", default=["auto", "fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    text = args.text.read_text()
    lines = (resources.files("kiln.perf") / "data" / "prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines]
    results, reference = {}, None
    for dtype in args.dtypes:
        llm = LLM("default", dtype=args.dtype, kv_cache_dtype=dtype, max_model_len=2048)
        ppl, tokens = perplexity(llm, text)
        replies = greedy(llm, prompts)
        reference = reference or replies
        firsts = [
            next(i for i, (a, b) in enumerate(zip(r, ref, strict=True)) if a != b)
            for r, ref in zip(replies, reference, strict=True)
            if r != ref
        ]
        results[dtype] = {
            "perplexity": ppl,
            "tokens": tokens,
            "identical_replies": sum(r == ref for r, ref in zip(replies, reference, strict=True))
            / len(replies),
            "mean_first_difference": sum(firsts) / len(firsts) if firsts else None,
        }
        print(dtype, json.dumps(results[dtype]), flush=True)
        del llm
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
