"""Sampling with FlashInfer's sort-free rejection-sampling kernels: kiln.ops.sampler.draw_tokens's
contract (vLLM's order: min-p on the whole distribution, then top-k, renormalise, top-p; a seeded row draws
from its own generator what it would draw alone)."""

from __future__ import annotations

import flashinfer.sampling as fs
import torch

from kiln.ops.sampler import apply_min_p
from kiln.ops.sampling_metadata import SamplingMetadata

Filter = torch.Tensor | float | None  # per row, one value for a single row, or off


def draw_tokens(
    logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None
) -> torch.Tensor:
    # vLLM's min-p masks the logits before top-k and top-p (its MinPLogitsProcessor); FlashInfer's min-p
    # kernel would apply it after them, to what they kept. The mask draws nothing, so every row, seeded or
    # not, takes it here.
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p)
    top_k = meta.top_k.to(torch.int32) if meta.top_k is not None else None
    if len(meta.seeded) < len(logits):
        out = _draw(logits, top_k, meta.top_p, generator).long()
    else:
        out = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
    # FlashInfer takes one generator per call: each seeded row is drawn again, alone, over the batch's
    # draw of it. (Drawing only the other rows would first copy them: rows x vocabulary floats more than
    # the memory profile's draw.)
    for row, s in meta.seeded.items():
        # The row's own filters pick its kernel, never its batch's: each kernel draws differently from the
        # same generator, so a batch's filters would change a seeded request's tokens.
        out[row : row + 1] = _draw(logits[row : row + 1], s.top_k, s.top_p, s.generator).long()
    return out


def _draw(x: torch.Tensor, top_k: Filter, top_p: Filter, gen: torch.Generator | None) -> torch.Tensor:
    if top_k is None and top_p is None:
        return fs.sampling_from_logits(x, generator=gen)
    if top_k is None:  # what the call below does after its top-k pass, which here would mask nothing
        return fs.top_p_sampling_from_probs(x.softmax(dim=-1), top_p, generator=gen)
    # "top_k_first": top-k, a softmax over what is left, then top-p: vLLM's order.
    return fs.top_k_top_p_sampling_from_logits(x, top_k, top_p if top_p is not None else 1.0, generator=gen)
