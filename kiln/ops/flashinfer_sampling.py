"""Sampling with FlashInfer's sort-free rejection-sampling kernels: kiln.ops.sampler.draw_tokens's
contract (vLLM's order: top-k, renormalise, top-p, then min-p; a seeded row draws from its own generator
what it would draw alone)."""

from __future__ import annotations

import flashinfer.sampling as fs
import torch

from kiln.ops.sampling_metadata import SamplingMetadata

Filter = torch.Tensor | float | None  # per row, one value for a single row, or off
MIN_P_FLOOR = 1e-30  # times the top probability (at least 1 / vocabulary), still a normal float32


def draw_tokens(
    logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None
) -> torch.Tensor:
    top_k = meta.top_k.to(torch.int32) if meta.top_k is not None else None
    top_p, min_p = meta.top_p, meta.min_p
    if len(meta.seeded) < len(logits):
        out = _draw(logits, top_k, top_p, min_p, generator).long()
    else:
        out = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
    # FlashInfer takes one generator per call: each seeded row is drawn again, alone, over the batch's
    # draw of it. (Drawing only the other rows would first copy them: rows x vocabulary floats more than
    # the memory profile's draw.)
    for row, s in meta.seeded.items():
        # The row's own filters pick its kernels, never its batch's: each kernel draws differently from the
        # same generator, so a batch's filters would change a seeded request's tokens.
        out[row : row + 1] = _draw(logits[row : row + 1], s.top_k, s.top_p, s.min_p, s.generator).long()
    return out


def _draw(
    x: torch.Tensor, top_k: Filter, top_p: Filter, min_p: Filter, gen: torch.Generator | None
) -> torch.Tensor:
    if min_p is None:
        if top_k is None and top_p is None:
            return fs.sampling_from_logits(x, generator=gen)
        if top_k is None:  # what the call below does after its top-k pass, which here would mask nothing
            return fs.top_p_sampling_from_probs(x.softmax(dim=-1), top_p, generator=gen)
        # "top_k_first": top-k, a softmax over what is left, then top-p: vLLM's order.
        return fs.top_k_top_p_sampling_from_logits(
            x, top_k, top_p if top_p is not None else 1.0, generator=gen
        )
    if isinstance(min_p, torch.Tensor):
        # A row with min-p off (0) would count every token valid in FlashInfer's kernel, those top-k or top-p
        # removed included, and where its uniform lands past the scanned sum (rounding, or a draw of exactly
        # 1) the kernel takes the last valid token: the vocabulary's last. A floor keeps removed ones out.
        min_p = min_p.clamp_min(MIN_P_FLOOR)
    probs = x.softmax(dim=-1)
    if top_k is not None:
        probs = fs.top_k_renorm_probs(probs, top_k)
    if top_p is not None:
        probs = fs.top_p_renorm_probs(probs, top_p)
    return fs.min_p_sampling_from_probs(probs, min_p, generator=gen)
