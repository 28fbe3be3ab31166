"""Prompts for a sweep point: random token ids of an exact length, or text prompts from a JSONL file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec

from kiln.perf.spec import Spec

BUILTIN = Path(__file__).parent / "data" / "prompts.jsonl"


class Prompt(msgspec.Struct):
    prompt: str | list[int]
    length: int | None  # known for token ids; for text the server's usage tells
    max_tokens: int


def around(length: int, ratio: float, rng: random.Random) -> int:
    """A length drawn uniformly from [length * (1 - ratio), length * (1 + ratio)], at least 1."""
    return max(1, rng.randint(round(length * (1 - ratio)), round(length * (1 + ratio))))


def make_prompts(
    spec: Spec,
    input_len: int,
    output_len: int,
    n: int,
    rng: random.Random,
    vocab_size: int | None = None,
) -> list[Prompt]:
    r_in, r_out = spec.range_ratio
    if spec.dataset == "random":
        lo, hi = spec.token_id_range
        if vocab_size is not None and hi > vocab_size:  # a small model: draw from its whole vocabulary
            lo, hi = min(lo, vocab_size // 2), vocab_size
        out = []
        for _ in range(n):
            length = around(input_len, r_in, rng)
            ids = [rng.randrange(lo, hi) for _ in range(length)]
            out.append(Prompt(ids, length, around(output_len, r_out, rng)))
        return out
    path = BUILTIN if spec.dataset == "builtin" else Path(spec.dataset)
    with path.open() as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()]
    if not texts:
        raise ValueError(f"dataset {path} holds no prompts")
    return [Prompt(rng.choice(texts), None, around(output_len, r_out, rng)) for _ in range(n)]
