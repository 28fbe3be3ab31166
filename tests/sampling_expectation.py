"""The distribution one sampling row must draw from, in vLLM's order (top-k, renormalise, top-p, then
min-p), computed directly from its definition; and the chi-square test both samplers are held to."""

import math

import torch

from kiln.ops.sampler import Draw, Sampler, SamplingMetadata
from kiln.sampling_params import SamplingParams

CASES = [  # (top_k, top_p, min_p): each filter alone, and the combinations whose order matters
    (5, 1.0, 0.0),
    (0, 0.7, 0.0),
    (6, 0.8, 0.0),
    (0, 1.0, 0.1),
    (8, 0.9, 0.05),
]


def expected_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits [V] -> the probabilities a correct sampler draws with (zero outside the kept set)."""
    probs = logits.double().softmax(-1)
    order = probs.argsort(descending=True)
    ranked = probs[order]
    if top_k:
        ranked = torch.where(torch.arange(len(ranked)) < top_k, ranked, 0)
    ranked = ranked / ranked.sum()
    # A token is kept while the mass ranked above it is still short of top_p.
    ranked = torch.where(ranked.cumsum(0) - ranked < top_p, ranked, 0)
    ranked = ranked / ranked.sum()
    ranked = torch.where(ranked >= min_p * ranked[0], ranked, 0)
    out = torch.zeros_like(probs)
    out[order] = ranked / ranked.sum()
    return out


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (z = 3.09), by Wilson-Hilferty (no scipy)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def check_distribution(
    draw: Draw | None, device: torch.device, top_k: int, top_p: float, min_p: float, draws: int = 40000
) -> None:
    """Samples one row of 20 logits `draws` times; nothing may land outside the kept set, and the counts
    must fit the expectation."""
    vocab = 20
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    expected = expected_probs(logits, top_k, top_p, min_p)
    keep = expected > 0
    params = [SamplingParams(temperature=1.0, top_k=top_k or -1, top_p=top_p, min_p=min_p)] * draws
    meta = SamplingMetadata.build(params, [None] * draws, [[]] * draws, vocab, device)
    sampler = Sampler(torch.Generator(device=device).manual_seed(1), draw=draw)
    ids = sampler(logits.to(device).expand(draws, -1).contiguous(), meta).token_ids.cpu()
    counts = torch.bincount(ids, minlength=vocab).double()
    assert counts[~keep].sum() == 0, f"drew tokens outside the kept set: {counts[~keep].tolist()}"
    exp = expected[keep] * draws
    stat = ((counts[keep] - exp) ** 2 / exp).sum().item()
    assert stat < chi_square_critical(int(keep.sum()) - 1), (stat, counts[keep].tolist(), exp.tolist())
