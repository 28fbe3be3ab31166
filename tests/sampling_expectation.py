"""The distribution one sampling row must draw from, in vLLM's order (min-p on the whole distribution, then
top-k, renormalise, top-p), computed directly from its definition; the chi-square test both samplers are
held to; and the seeded row's independence of its batch, which both samplers keep too."""

import math

import torch

from kiln.ops.sampler import Draw, Sampler
from kiln.ops.sampling_metadata import Penalties, SamplingMetadata
from kiln.sampling_params import SamplingParams

CASES = [  # (top_k, top_p, min_p): each filter alone, and the combinations whose order matters
    (5, 1.0, 0.0),
    (0, 0.7, 0.0),
    (6, 0.8, 0.0),
    (0, 1.0, 0.1),
    (8, 0.9, 0.05),
    (0, 0.8, 0.1),
]


def expected_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits [V] -> the probabilities a correct sampler draws with (zero outside the kept set)."""
    probs = logits.double().softmax(-1)
    order = probs.argsort(descending=True)
    ranked = probs[order]
    ranked = torch.where(ranked >= min_p * ranked[0], ranked, 0)
    if top_k:
        ranked = torch.where(torch.arange(len(ranked)) < top_k, ranked, 0)
    ranked = ranked / ranked.sum()
    # A token is kept while the mass ranked above it is still short of top_p.
    ranked = torch.where(ranked.cumsum(0) - ranked < top_p, ranked, 0)
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


def _step_logits(request: int, step: int, vocab_size: int) -> torch.Tensor:
    """The model's logits for a request at a step, independent of the batch it is in."""
    return torch.randn(vocab_size, generator=torch.Generator().manual_seed(1000 * request + step)) * 3


def _run(
    draw: Draw | None,
    device: torch.device,
    requests: list[tuple[int, SamplingParams, int | None]],
    steps: int,
    vocab_size: int,
    order_seed: int,
) -> dict[int, list[int]]:
    """Decode `steps` tokens for each (request id, params, seed), shuffling the batch order each step."""
    outputs: dict[int, list[int]] = {rid: [] for rid, _, _ in requests}
    generators = {
        rid: torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        for rid, _, seed in requests
    }
    sampler = Sampler(torch.Generator(device=device).manual_seed(order_seed), draw=draw)
    order = torch.Generator().manual_seed(order_seed)
    for step in range(steps):
        batch = [requests[i] for i in torch.randperm(len(requests), generator=order).tolist()]
        # Requests that started earlier sit at later positions of their sequence.
        logits = torch.stack([_step_logits(rid, step + 3 * rid, vocab_size) for rid, _, _ in batch])
        params = [p for _, p, _ in batch]
        penalties = None
        if any(p.uses_penalties for p in params):
            prompts = [[rid, rid + 1] for rid, _, _ in batch]
            penalties = Penalties.from_ids(
                params, prompts, [outputs[r] for r, _, _ in batch], vocab_size, device
            )
        meta = SamplingMetadata.build(
            params, [generators[rid] for rid, _, _ in batch], [[]] * len(batch), vocab_size, device, penalties
        )
        for (rid, _, _), token in zip(
            batch, sampler(logits.to(device), meta).token_ids.tolist(), strict=True
        ):
            outputs[rid].append(token)
    return outputs


def check_seeded_row_is_independent(draw: Draw | None, device: torch.device) -> None:
    """A seeded row draws the same tokens alone and in batches whose other rows use other filters (top-k,
    min-p, none), penalties, seeds or none, in any order."""
    vocab_size, steps = 40, 12
    mine = (0, SamplingParams(seed=7, temperature=1.3, top_p=0.9, presence_penalty=0.5), 7)
    others = [
        (1, SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3), None),
        (2, SamplingParams(seed=3, min_p=0.1, logit_bias={4: 2.0}), 3),
        (3, SamplingParams(temperature=0.0, frequency_penalty=1.0), None),
    ]
    alone = _run(draw, device, [mine], steps, vocab_size, order_seed=0)[0]
    assert len(set(alone)) > 1
    for order_seed in range(3):
        assert _run(draw, device, [mine, *others], steps, vocab_size, order_seed)[0] == alone
    # The same seed at a different position of the list and under other unseeded noise.
    assert _run(draw, device, [*others, mine], steps, vocab_size, order_seed=9)[0] == alone
    # Beside rows whose filters are none at all, or top-k alone.
    plain = [(4, SamplingParams(temperature=1.0), None), (5, SamplingParams(top_k=3), 11)]
    assert _run(draw, device, [*plain, mine], steps, vocab_size, order_seed=4)[0] == alone
