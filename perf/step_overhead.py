"""Engine step overhead against output length: what a step costs besides the model's forward.

8 requests of 4,096 output tokens each, `logprobs=5`, `repetition_penalty=1.1`, seeded random sampling,
driven offline through LLMEngine.step, whose outputs are what the server streams. The model is a tiny
random Llama (2 layers, hidden 64) with the default model's tokenizer and vocabulary, so the forward is
small and everything the engine does around it (scheduling, batch building, sampling with penalties and
logprobs, detokenizing, stop checks, outputs) shows. The forward is timed by the model's forward hooks
and subtracted from each step.

Reported: the median step overhead over output tokens 50-150 and 3,950-4,050, and their ratio (target:
within 10%). Overhead that grows with each request's history shows as a ratio above 1.

    python perf/step_overhead.py [--mode compiled] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

TOKENS = 4096
REQUESTS = 8
WINDOWS = {"token 100": (50, 150), "token 4000": (3950, 4050)}


def tiny_model(path: Path) -> Path:
    """A 2-layer random Llama with the default model's tokenizer (its vocabulary size, 49,152)."""
    from kiln.models.loader import resolve_model

    tokenizer_dir = resolve_model("default")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run(model: Path, mode: str) -> dict:
    from kiln import LLM, SamplingParams

    llm = LLM(str(model), mode=mode, dtype="float32", max_model_len=TOKENS + 64)
    engine = llm.engine
    forward = [0.0]
    started = [0.0]
    engine.model.register_forward_pre_hook(lambda *_: started.__setitem__(0, time.perf_counter()))
    engine.model.register_forward_hook(lambda *_: forward.__setitem__(0, time.perf_counter() - started[0]))
    for i in range(REQUESTS):
        params = SamplingParams(
            temperature=1.0, seed=i, max_tokens=TOKENS, ignore_eos=True, logprobs=5,
            repetition_penalty=1.1,
        )  # fmt: skip
        engine.add_request(f"r{i}", list(range(1000 + 16 * i, 1016 + 16 * i)), params)
    overhead: list[float] = []  # per decode step, indexed by output tokens so far
    while engine.has_unfinished():
        forward[0] = 0.0
        clock = time.perf_counter()
        engine.step()
        overhead.append(time.perf_counter() - clock - forward[0])
    # Step 0 is the prefill; step s produces output token s + 1 of every request.
    report = {}
    for name, (lo, hi) in WINDOWS.items():
        report[name] = statistics.median(overhead[lo:hi]) * 1e3
        logging.info("step overhead at %s: %.3f ms (median of steps %d-%d)", name, report[name], lo, hi)
    report["ratio"] = report["token 4000"] / report["token 100"]
    logging.info("ratio token 4000 / token 100: %.3f (target <= 1.10)", report["ratio"])
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="compiled", choices=["eager", "compiled"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(tempfile.mkdtemp(prefix="kiln-step-overhead-"))
    try:
        report = run(tiny_model(root / "tiny-llama"), args.mode)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "mode": args.mode,
        "step_overhead_ms": report,
    }
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
