"""What a LoRA adapter costs the default model offline: decode steps at batch 1 and 16, and a 2,048-token
prefill (16 prompts of 128 tokens, prefix caching off), with the adapter or without. --make-adapter writes
a random rank-16 PEFT adapter of all seven projections (alpha 32) for the default model first, the one
BENCHMARKS.md's LoRA serving runs use.

    python perf/lora_steps.py --make-adapter /tmp/bench/lora-sql
    python perf/lora_steps.py --adapter /tmp/bench/lora-sql    # and without --adapter: the base model
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.models.lora_adapters


def make_adapter(folder: Path) -> None:
    import torch
    import transformers

    from kiln.models.convert import default_model_dir
    from tests.models.lora_adapters import save_adapter

    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    save_adapter(folder, hf, seed=7, rank=16, alpha=32.0)


def measure(adapter: Path | None) -> dict[str, float]:
    from kiln import LLM, LoRARequest, SamplingParams

    options = {"enable_lora": True, "max_lora_rank": 16} if adapter else {}
    llm = LLM("default", max_model_len=1024, kv_cache_gib=0.2, enable_prefix_caching=False, **options)
    lora = LoRARequest("bench", 1, str(adapter)) if adapter else None
    out: dict[str, float] = {}
    decode = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    for batch in (1, 16):
        prompts = [{"prompt_token_ids": [100 + i, 200, 300]} for i in range(batch)]
        llm.generate(prompts, decode, use_tqdm=False, lora_request=lora)  # warm
        clock = time.perf_counter()
        llm.generate(prompts, decode, use_tqdm=False, lora_request=lora)
        out[f"decode_batch{batch}_ms_per_step"] = (time.perf_counter() - clock) / 256 * 1000
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 228 + i))} for i in range(16)]
    llm.generate(prompts, prefill, use_tqdm=False, lora_request=lora)
    times = []
    for _ in range(3):
        clock = time.perf_counter()
        llm.generate(prompts, prefill, use_tqdm=False, lora_request=lora)
        times.append(time.perf_counter() - clock)
    out["prefill_16x128_ms_best_of_3"] = min(times) * 1000
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--adapter", type=Path, help="a PEFT adapter folder (none: the base model)")
    parser.add_argument("--make-adapter", type=Path, metavar="DIR", help="write the random adapter and stop")
    args = parser.parse_args()
    if args.make_adapter:
        make_adapter(args.make_adapter)
        return
    print(json.dumps({"adapter": str(args.adapter), **measure(args.adapter)}, indent=2))


if __name__ == "__main__":
    main()
