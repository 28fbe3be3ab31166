"""The engine's host work per decode step at a large batch: what a GPU step waits on, or async scheduling
must hide, measured where the forward costs next to nothing.

nano-vllm's workload shape (256 requests, prompts of 100-1,024 random tokens, outputs up to 1,024,
ignore_eos), driven offline through LLMEngine.step(final_only=True) as LLM.generate drives it, on a 1-layer
random Llama (hidden 64) with a 256-token vocabulary, so sampling costs little on the CPU too. Once every
prompt is prefilled it times STEPS decode steps at the full batch; the forward is timed by the model's
forward hooks and subtracted. --profile prints cProfile's top functions over the same steps.

    python perf/host_overhead.py [--steps 200] [--repeats 3] [--profile] [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import platform
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.append(str(Path(__file__).parents[1]))  # the tests' tiny models (after PYTHONPATH: a worktree)
from tests.models.tiny import VOCAB, save_tokenizer

REQUESTS = 256


def tiny_model(path: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    save_tokenizer(path)
    return path


def run(model: Path, steps: int, repeats: int, profile: bool) -> list[float]:
    from kiln import LLM, SamplingParams

    llm = LLM(
        str(model), mode="eager", dtype="float32", max_model_len=2304, max_num_seqs=REQUESTS,
        max_num_batched_tokens=16384,
    )  # fmt: skip
    engine = llm.engine
    forward = [0.0, 0.0]  # (started, seconds this step)
    engine.model.register_forward_pre_hook(lambda *_: forward.__setitem__(0, time.perf_counter()))
    engine.model.register_forward_hook(
        lambda *_: forward.__setitem__(1, forward[1] + time.perf_counter() - forward[0])
    )
    rng = random.Random(0)
    medians = []
    for repeat in range(repeats):
        for i in range(REQUESTS):
            prompt = [rng.randrange(256) for _ in range(rng.randint(100, 1024))]
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 64)
            engine.add_request(f"{repeat}-{i}", prompt, params)
        running = engine.scheduler.running
        while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in running):
            engine.step(final_only=True)
        for _ in range(8):
            engine.step(final_only=True)
        profiler = cProfile.Profile() if profile and repeat == repeats - 1 else None
        if profiler is not None:
            profiler.enable()
        host = []
        for _ in range(steps):
            forward[1] = 0.0
            clock = time.perf_counter()
            engine.step(final_only=True)
            host.append(time.perf_counter() - clock - forward[1])
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        assert len(running) == REQUESTS
        medians.append(statistics.median(host) * 1e3)
        logging.info("repeat %d: host work %.3f ms a step at batch %d", repeat, medians[-1], REQUESTS)
        while engine.has_unfinished():
            engine.step(final_only=True)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(tempfile.mkdtemp(prefix="kiln-host-overhead-"))
    try:
        medians = run(tiny_model(root / "tiny-llama"), args.steps, args.repeats, args.profile)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "batch": REQUESTS,
        "host_ms_per_step": [round(m, 3) for m in medians],
        "best": round(min(medians), 3),
    }
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
