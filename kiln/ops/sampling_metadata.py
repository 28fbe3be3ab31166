"""What a step's sampling reads, per row: the penalties' token histories, each seeded row's generator and
filters, and the batch's filters as tensors (SamplingMetadata), built once per step from the requests'
SamplingParams."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.ops.transfer import to_device
from kiln.sampling_params import SamplingParams


@dataclass(slots=True)
class Penalties:
    """Repetition, frequency and presence penalties; built only when some row uses one."""

    repetition: torch.Tensor  # [B, 1] float32, 1.0 where off
    frequency: torch.Tensor  # [B, 1] float32, 0.0 where off
    presence: torch.Tensor  # [B, 1] float32, 0.0 where off
    prompt_mask: torch.Tensor  # [B, V] bool: the token occurs in the prompt
    output_counts: torch.Tensor  # [B, V] int32: occurrences of the token in the output so far

    @classmethod
    def build(
        cls, params: list[SamplingParams], prompt_mask: torch.Tensor, output_counts: torch.Tensor
    ) -> Penalties:
        def column(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, prompt_mask.device)[:, None]

        return cls(
            repetition=column([p.repetition_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            presence=column([p.presence_penalty for p in params]),
            prompt_mask=prompt_mask,
            output_counts=output_counts,
        )

    @classmethod
    def from_ids(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
    ) -> Penalties:
        mask = token_counts(prompt_ids, vocab_size, device) > 0
        return cls.build(params, mask, token_counts(output_ids, vocab_size, device))


def token_counts(ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(ids), vocab_size] int32, contiguous: how often each token occurs in each row of ids. Contiguous
    as TokenCounts' rows are: the Triton prep kernel is built for its row stride's divisibility, and warmup
    builds it from these."""
    width = max((len(row) for row in ids), default=0)
    padded = to_device([row + [vocab_size] * (width - len(row)) for row in ids], torch.int64, device)
    padded = padded.view(len(ids), width)
    counts = torch.zeros(len(ids), vocab_size, dtype=torch.int32, device=device)
    # A padding id (vocab_size) is clamped onto the last token and adds 0 to it.
    counts.scatter_add_(1, padded.clamp(max=vocab_size - 1), (padded < vocab_size).to(torch.int32))
    return counts


@dataclass(frozen=True, slots=True)
class Seeded:
    """A seeded random row: its own generator, and its own top-k/top-p on the host (None where off), so a
    sampler can draw it as it would alone, whatever else its batch holds. (Min-p is a mask before the draw,
    the same in any batch.)"""

    generator: torch.Generator
    top_k: int | None
    top_p: float | None


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling state for one step. Optional fields are None when no row needs them."""

    temperature: torch.Tensor  # [B] float32, 1.0 on greedy rows
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where off
    top_p: torch.Tensor | None  # [B] float32, 1.0 where off
    min_p: torch.Tensor | None  # [B] float32, 0.0 where off
    penalties: Penalties | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids)
    only: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # allowed_token_ids: (rows, which row, ids)
    seeded: dict[int, Seeded]  # row -> its own generator and filters, for seeded random rows only
    want_logprobs: bool  # some row asked for logprobs, possibly 0 (the sampled token's only)
    max_logprobs: int  # max over rows of params.logprobs (0 when none asked)
    allowed: tuple[torch.Tensor, list[int]] | None = None  # (token bitmask [B, V/32] int32, its rows)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        penalties: Penalties | None = None,
        allowed: tuple[torch.Tensor, list[int]] | None = None,
        forced: dict[int, int] | None = None,
    ) -> SamplingMetadata:
        """penalties: the rows' token histories, needed when some row uses a penalty; allowed: the
        structured-output rows' token bitmask (kiln.engine.grammar); forced: row -> the one token it
        must sample (a reasoning budget's closing tag, kiln.engine.thinking). A forced row's logprobs stay
        the model's own, as vLLM's."""
        greedy = [p.greedy for p in params]

        # Greedy rows never reach the filters: they count as off, so they don't trigger that work.
        def per_row(value: Callable[[SamplingParams], float], off: float) -> list[float]:
            return [off if g else value(p) for p, g in zip(params, greedy, strict=True)]

        temperature = per_row(lambda p: p.temperature, 1.0)
        top_k = per_row(lambda p: min(p.top_k_or_off or vocab_size, vocab_size), vocab_size)
        top_p = per_row(lambda p: p.top_p, 1.0)
        min_p = per_row(lambda p: p.min_p, 0.0)
        if penalties is None and any(p.uses_penalties for p in params):
            raise ValueError("a row uses a penalty: pass its token histories (penalties)")

        bias = [(row, tok, val) for row, p in enumerate(params) for tok, val in (p.logit_bias or {}).items()]
        if any(not 0 <= tok < vocab_size for _, tok, _ in bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
        # A banned id outside the vocabulary can never be sampled anyway.
        banned = [(row, tok) for row, ids in enumerate(banned_ids) for tok in ids if 0 <= tok < vocab_size]
        choices = {row: ids for row, p in enumerate(params) if (ids := p.allowed_token_ids) is not None}
        if forced:  # a forced token wins over bans and allowed_token_ids: the row must have it to draw
            banned = [(row, tok) for row, tok in banned if row not in forced]
            choices |= {row: [token] for row, token in forced.items()}
        only_rows = sorted(choices)
        only = [(i, tok) for i, row in enumerate(only_rows) for tok in choices[row]]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        return cls(
            temperature=tensor(temperature, torch.float32),
            greedy=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            top_k=tensor(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
            top_p=tensor(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            min_p=tensor(min_p, torch.float32) if any(p > 0.0 for p in min_p) else None,
            penalties=penalties,
            logit_bias=(
                tensor([r for r, _, _ in bias], torch.int64),
                tensor([t for _, t, _ in bias], torch.int64),
                tensor([v for _, _, v in bias], torch.float32),
            )
            if bias
            else None,
            banned=(tensor([r for r, _ in banned], torch.int64), tensor([t for _, t in banned], torch.int64))
            if banned
            else None,
            only=(
                tensor(only_rows, torch.int64),
                tensor([i for i, _ in only], torch.int64),
                tensor([t for _, t in only], torch.int64),
            )
            if only_rows
            else None,
            seeded={
                row: Seeded(
                    g,
                    int(top_k[row]) if top_k[row] < vocab_size else None,
                    top_p[row] if top_p[row] < 1.0 else None,
                )
                for row, g in enumerate(generators)
                if g is not None and not greedy[row]
            },
            want_logprobs=any(p.logprobs is not None for p in params),
            max_logprobs=max((p.logprobs or 0 for p in params), default=0),
            allowed=allowed,
        )
