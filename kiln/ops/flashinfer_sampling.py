"""Sampling with FlashInfer's sort-free rejection-sampling kernels: kiln.ops.sampler.draw_tokens's
contract (vLLM's order: top-k, renormalise, top-p, then min-p; seeded rows draw only from their own
generator)."""

from __future__ import annotations

import flashinfer.sampling as fs
import torch

from kiln.ops.sampler import SamplingMetadata
from kiln.ops.transfer import to_device


def draw_tokens(
    logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None
) -> torch.Tensor:
    top_k = meta.top_k.to(torch.int32) if meta.top_k is not None else None
    top_p, min_p = meta.top_p, meta.min_p

    def draw(rows: torch.Tensor | slice, gen: torch.Generator | None) -> torch.Tensor:
        x = logits[rows]
        if min_p is None:
            if top_k is None and top_p is None:
                return fs.sampling_from_logits(x, generator=gen)
            # "top_k_first": top-k, a softmax over what is left, then top-p: vLLM's order.
            k = top_k[rows] if top_k is not None else x.shape[-1]
            return fs.top_k_top_p_sampling_from_logits(
                x, k, top_p[rows] if top_p is not None else 1.0, generator=gen
            )
        probs = x.softmax(dim=-1)
        if top_k is not None:
            probs = fs.top_k_renorm_probs(probs, top_k[rows])
        if top_p is not None:
            probs = fs.top_p_renorm_probs(probs, top_p[rows])
        return fs.min_p_sampling_from_probs(probs, min_p[rows], generator=gen)

    if not meta.generators:
        return draw(slice(None), generator).long()
    # FlashInfer takes one generator per call: seeded rows are drawn one call each, the rest together.
    out = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
    seeded = list(meta.generators)
    rest = torch.ones(len(logits), dtype=torch.bool)
    rest[seeded] = False
    if rest.any():
        idx = to_device(rest.nonzero().flatten(), None, logits.device)
        out[idx] = draw(idx, generator).long()
    for row, own in meta.generators.items():
        out[row : row + 1] = draw(slice(row, row + 1), own).long()
    return out
