"""FlashInfer attention and sampling against the torch references, on the GPU."""

import math

import numpy as np
import pytest
import torch

from kiln.engine.sampler import Sampler, SamplingMetadata
from kiln.ops.attention import TORCH_ATTENTION, AttnMetadata, StepLayout
from kiln.sampling_params import SamplingParams

BS, H, KVH, D, BLOCKS = 16, 8, 2, 64, 64


def _step(ctx_lens: list[int], q_lens: list[int], decode_only: bool):
    """A step over a random bf16 cache: request i has ctx_lens[i] cached tokens and q_lens[i] new ones."""
    from kiln.ops.flashinfer_attention import FlashInferAttention

    torch.manual_seed(0)
    dev = torch.device("cuda")
    cache = torch.randn(BLOCKS + 1, 2, BS, KVH, D, device=dev, dtype=torch.bfloat16)
    seq = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    width = max(2, max(-(-s // BS) for s in seq))
    perm = np.random.default_rng(0).permutation(BLOCKS)[: len(seq) * width].reshape(len(seq), width)
    table = perm.astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx_lens, q_lens, strict=True)])
    req = np.repeat(np.arange(len(seq)), q_lens)
    slots = table[req, positions // BS].astype(np.int64) * BS + positions % BS
    T = int(qsl[-1])
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    meta = AttnMetadata(
        torch.from_numpy(slots).to(dev),
        torch.from_numpy(qsl).to(dev),
        torch.tensor(seq, dtype=torch.int32, device=dev),
        torch.from_numpy(table).to(dev),
        decode_only,
    )
    fi = FlashInferAttention(H, KVH, D, BS, torch.bfloat16, dev, width, D**-0.5, 0)
    fi.plan(StepLayout(qsl, np.array(seq, dtype=np.int32), table, decode_only, False))
    ref_cache = cache.clone()
    want = TORCH_ATTENTION.forward(q, k, v, ref_cache, meta, D**-0.5, 0)
    got = fi.forward(q, k, v, cache, meta, D**-0.5, 0)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(cache[:BLOCKS], ref_cache[:BLOCKS])  # the same K/V landed in the same slots


def test_prefill() -> None:
    _step([0, 0, 0], [37, 5, 16], decode_only=False)


def test_decode() -> None:
    _step([40, 1, 15, 100], [1, 1, 1, 1], decode_only=True)


def test_chunked_prefill_on_a_cached_prefix_mixed_with_decodes() -> None:
    _step([48, 20, 7], [33, 1, 1], decode_only=False)


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    # Wilson-Hilferty: the chi-square quantile at p = 0.001 (z = 3.09) without scipy.
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.7), (6, 0.8)])
def test_flashinfer_sampling_distribution(top_k: int, top_p: float) -> None:
    from kiln.ops.flashinfer_sampling import draw_tokens

    vocab, draws = 20, 40000
    torch.manual_seed(0)
    logits = torch.randn(vocab, device="cuda") * 1.5
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(vocab, dtype=torch.bool, device="cuda")
    ranked = probs[order]
    kept = (ranked.cumsum(0) - ranked) < top_p
    if top_k:
        kept &= torch.arange(vocab, device="cuda") < top_k
    keep[order[kept]] = True
    expected = torch.where(keep, probs, 0) / probs[keep].sum()

    params = [SamplingParams(temperature=1.0, top_k=top_k or -1, top_p=top_p)] * draws
    meta = SamplingMetadata.build(params, [[0]] * draws, [[]] * draws, [None] * draws, [[]] * draws, vocab,
                                  torch.device("cuda"))  # fmt: skip
    sampler = Sampler(torch.Generator(device="cuda").manual_seed(1), draw=draw_tokens)
    ids = sampler(logits.expand(draws, -1).contiguous(), meta).token_ids
    counts = torch.bincount(ids, minlength=vocab).double()
    assert counts[~keep].sum() == 0  # nothing outside top-k / top-p, ever
    exp = expected[keep].double() * draws
    stat = ((counts[keep] - exp) ** 2 / exp).sum().item()
    assert stat < _chi_square_critical(int(keep.sum()) - 1)
