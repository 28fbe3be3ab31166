"""Sampling with FlashInfer's sort-free rejection-sampling kernels: kiln.engine.sampler.draw_tokens's
contract (same per-row min-p, top-k and top-p; seeded rows draw only from their own generator)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import flashinfer.sampling
import torch

from kiln.engine.sampler import apply_min_p

if TYPE_CHECKING:
    from kiln.engine.sampler import SamplingMetadata


def draw_tokens(
    logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None
) -> torch.Tensor:
    if meta.min_p is not None:
        # FlashInfer's min-p kernel takes probabilities and no top-k/top-p alongside: mask first instead.
        apply_min_p(logits, meta.min_p)
    top_k = meta.top_k.to(torch.int32) if meta.top_k is not None else None
    top_p = meta.top_p

    def draw(rows: torch.Tensor | slice, gen: torch.Generator | None) -> torch.Tensor:
        if top_k is None and top_p is None:
            return flashinfer.sampling.sampling_from_logits(logits[rows], generator=gen)
        return flashinfer.sampling.top_k_top_p_sampling_from_logits(
            logits[rows],
            top_k[rows] if top_k is not None else logits.shape[-1],
            top_p[rows] if top_p is not None else 1.0,
            generator=gen,
        )

    if not meta.generators:
        return draw(slice(None), generator).long()
    # FlashInfer takes one generator per call: seeded rows are drawn one call each, the rest together.
    out = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
    seeded = list(meta.generators)
    rest = torch.ones(len(logits), dtype=torch.bool)
    rest[seeded] = False
    if rest.any():
        idx = rest.nonzero().flatten().to(logits.device)
        out[idx] = draw(idx, generator).long()
    for row, own in meta.generators.items():
        out[row : row + 1] = draw(slice(row, row + 1), own).long()
    return out
