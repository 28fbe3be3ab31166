"""The sampler's draw alone (kiln.ops.sampler.draw_tokens, the CPU's and the torch backend's), on the
default model's own logits: transformers generates from kiln's built-in prompts (temperature 1, top-p
0.95), and its logits at each step are the rows; B rows a draw, every row with the same filters, the median
over steps.

    cd /tmp && PYTHONPATH=<tree> python <tree>/perf/sampler_draw.py [--batch 1 64] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

from kiln.models.loader import resolve_model
from kiln.ops.sampler import draw_tokens
from kiln.ops.sampling_metadata import SamplingMetadata
from kiln.perf.dataset import BUILTIN
from kiln.sampling_params import SamplingParams

FILTERS = {  # what a request sends beside temperature 1
    "none": {},
    "top-p 0.95": {"top_p": 0.95},
    "top-k 50": {"top_k": 50},
    "top-p 0.9, min-p 0.05": {"top_p": 0.9, "min_p": 0.05},
}


def model_logits(prompts: int, tokens: int) -> torch.Tensor:
    path = resolve_model("default")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = []
    torch.manual_seed(0)
    for line in BUILTIN.read_text().splitlines()[:prompts]:
        chat = [{"role": "user", "content": json.loads(line)["prompt"]}]
        ids = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        out = model.generate(
            **ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, top_p=0.95, top_k=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        rows += [step[0] for step in out.logits]
    return torch.stack(rows).float()


def median_ms(logits: torch.Tensor, batch: int, steps: int, filters: dict[str, float]) -> float:
    vocab = logits.shape[-1]
    p = SamplingParams(temperature=1.0, **filters)  # type: ignore[arg-type]
    meta = SamplingMetadata.build([p] * batch, [None] * batch, [[]] * batch, vocab, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    times = []
    for step in range(steps):
        at = torch.arange(step * batch, (step + 1) * batch) % len(logits)
        x = logits[at]  # a copy: the draw filters its logits in place
        clock = time.perf_counter()
        draw_tokens(x, meta, generator)
        times.append(time.perf_counter() - clock)
    return statistics.median(times[steps // 10 :]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    logits = model_logits(prompts=4, tokens=64)
    for batch in args.batch:
        for name, filters in FILTERS.items():
            ms = median_ms(logits, batch, args.steps, filters)
            print(f"batch {batch:3d}, {name:22s} {ms:8.3f} ms a draw")


if __name__ == "__main__":
    main()
