"""Offline throughput: kiln's LLM.generate against transformers' generate, same model, lengths and dtype.

64 requests (seed 0), prompt lengths uniform in [64, 512], output lengths uniform in [64, 256],
ignore_eos, greedy. transformers runs batched and left-padded, requests sorted by output length so each
batch wastes little; only the requested tokens count as its output.

    python perf/offline_throughput.py --dtype bfloat16 [--model DIR] [--hf-batch-size 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len, output_len = rng.randint(64, 512), rng.randint(64, 256)
        out.append(([rng.randrange(100, vocab) for _ in range(prompt_len)], output_len))
    return out


def run_kiln(model: str, dtype: str, work: list[tuple[list[int], int]]) -> float:
    from kiln import LLM, SamplingParams

    llm = LLM(model, dtype=dtype)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # first-call costs
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in work], params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in work]
    return elapsed


def run_transformers(model: str, dtype: str, work: list[tuple[list[int], int]], batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    order = sorted(range(len(work)), key=lambda i: work[i][1])
    start = time.perf_counter()
    for b in tqdm(range(0, len(order), batch_size), desc="transformers"):
        batch = [work[i] for i in order[b : b + batch_size]]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(n for _, n in batch)
        with torch.inference_mode():
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from kiln.models.loader import resolve_model

    model = str(resolve_model(args.model))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    work = workload(args.num_requests, vocab, seed=0)
    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(n for _, n in work)

    results = {"kiln": run_kiln(model, args.dtype, work)}
    if not args.skip_transformers:
        results["transformers"] = run_transformers(model, args.dtype, work, args.hf_batch_size)

    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "requests": args.num_requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "engines": {
            name: {
                "seconds": round(t, 2),
                "output_tok_s": round(output_tokens / t, 1),
                "total_tok_s": round((prompt_tokens + output_tokens) / t, 1),
            }
            for name, t in results.items()
        },
    }
    if "transformers" in results:
        report["kiln_vs_transformers_total"] = round(results["transformers"] / results["kiln"], 2)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
