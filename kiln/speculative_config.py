"""vLLM's --speculative-config: the drafting method and how many drafts a step may check."""

from __future__ import annotations

import itertools
from typing import Annotated

from msgspec import Meta

from kiln.config_section import Section


class SpeculativeConfig(Section):
    """vLLM's --speculative-config, for its prompt-lookup (n-gram) method: each decoding request drafts up to
    num_speculative_tokens tokens by finding its last n tokens (prompt_lookup_max down to prompt_lookup_min)
    earlier in its prompt and output, and one step checks them all. Either lookup bound alone sets both;
    neither: 5, as vLLM."""

    method: str | None = None
    model: str | None = None  # vLLM's older spelling of the method ("ngram")
    num_speculative_tokens: Annotated[int, Meta(ge=1)] | None = None
    prompt_lookup_max: Annotated[int, Meta(ge=1)] | None = None
    prompt_lookup_min: Annotated[int, Meta(ge=1)] | None = None
    # vLLM's dynamic speculative decoding: [range_start, range_end, k] (inclusive batch-size ranges, the first
    # from 1): a step of that many running requests drafts at most k tokens each (a batch past a range keeps
    # the k before it). Where a step's extra tokens cost more than its drafts keep (large batches on a CPU).
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None

    def __post_init__(self) -> None:
        method = self.method or self.model
        if method not in ("ngram", "[ngram]"):
            raise ValueError(
                f"speculative method {method!r} is not built: kiln drafts by prompt lookup only "
                '({"method": "ngram"}); draft models, EAGLE, Medusa and MTP are not'
            )
        if self.num_speculative_tokens is None:
            raise ValueError("num_speculative_tokens is needed with the ngram method")
        self.method, self.model = "ngram", None
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        self.prompt_lookup_min = low or high or 5
        self.prompt_lookup_max = high or low or 5
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} must be <= prompt_lookup_max="
                f"{self.prompt_lookup_max}"
            )
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is not None:
            self.num_speculative_tokens_per_batch_size = _batch_schedule(schedule)

    @property
    def summary(self) -> str:
        by_batch = self.num_speculative_tokens_per_batch_size
        by_batch_text = f" (by batch: {by_batch})" if by_batch else ""
        lookup = f"{self.prompt_lookup_min}-{self.prompt_lookup_max}"
        return f"ngram, {self.num_speculative_tokens} tokens{by_batch_text}, lookup {lookup}"


def _batch_schedule(schedule: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """num_speculative_tokens_per_batch_size checked as vLLM checks it, sorted by range."""
    if not schedule:
        raise ValueError("num_speculative_tokens_per_batch_size must not be empty.")
    for start, end, k in schedule:
        if start <= 0 or end <= 0:
            raise ValueError(f"Batch-size range ({start}, {end}) must be positive.")
        if start > end:
            raise ValueError(f"Batch-size range start must be <= end for ({start}, {end}, {k}).")
        if k < 0:
            raise ValueError("num_speculative_tokens_per_batch_size values must be >= 0.")
    schedule = sorted(schedule)
    if any(start <= before[1] for before, (start, _, _) in itertools.pairwise(schedule)):
        raise ValueError("Batch-size ranges must be non-overlapping and sorted.")
    if schedule[0][0] != 1:
        raise ValueError(
            "The first batch-size range must start at 1 so every runtime batch size has a defined schedule."
        )
    return schedule
