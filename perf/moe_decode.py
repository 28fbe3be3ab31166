"""Offline decode on a mid-size random Qwen3-MoE (8 layers, hidden 1024, 16 experts of width 512, top 4;
bfloat16, 4,096-word vocabulary): output tok/s at batch 1 and 16, 64 prompt and 64 output tokens each,
greedy. `--engine vllm` runs the same under vLLM (with vLLM's own Python and CPU settings), on the model
a kiln run made.

    .venv/bin/python perf/moe_decode.py [--engine kiln] [--dtype bfloat16]
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=1 LD_PRELOAD=libtcmalloc_minimal.so.4 \\
        /work/.venv-vllm-cpu/bin/python perf/moe_decode.py --engine vllm
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

VOCAB = 4096
MODEL = Path("/tmp/kiln-perf-moe")
QWEN3_MOE = dict(
    vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512,
    norm_topk_prob=True, max_position_embeddings=4096,
)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["kiln", "vllm"], default="kiln")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if args.engine == "kiln":
        from gpu_bench import random_model

        from kiln import LLM, SamplingParams

        random_model("Qwen3MoeConfig", QWEN3_MOE, MODEL, device="cpu")

        llm = LLM(str(MODEL), dtype=args.dtype, kv_cache_gib=0.5, max_model_len=1024)
    else:
        if not MODEL.is_dir():
            raise SystemExit(f"{MODEL} is made by a kiln run: run perf/moe_decode.py --engine kiln first")
        from vllm import LLM, SamplingParams

        llm = LLM(str(MODEL), dtype=args.dtype, max_model_len=1024, seed=0)
    rng = random.Random(0)
    result = {}
    for batch in (1, 16):
        # Both engines take a prompt of token ids as this dict (vLLM's TokensPrompt).
        prompts = [{"prompt_token_ids": [rng.randrange(100, VOCAB) for _ in range(64)]} for _ in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        clock = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        result[batch] = round(batch * 64 / (time.perf_counter() - clock), 1)
    print(f"{args.engine} {args.dtype}: output tok/s by batch {result}")


if __name__ == "__main__":
    main()
