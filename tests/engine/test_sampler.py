from __future__ import annotations

import math

import msgspec
import pytest
import torch

from kiln.ops.logprobs import compute_logprobs
from kiln.ops.sampler import (
    Sampler,
    _draw_among_candidates,
    _top_k_top_p,
    apply_penalties,
)
from kiln.ops.sampling_metadata import Penalties, SamplingMetadata
from kiln.sampling_params import SamplingParams
from tests.sampling_expectation import (
    CASES,
    check_distribution,
    check_seeded_row_is_independent,
    expected_probs,
)

CPU = torch.device("cpu")


def build(
    params: list[SamplingParams],
    vocab_size: int,
    prompt_ids: list[list[int]] | None = None,
    output_ids: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    banned_ids: list[list[int]] | None = None,
) -> SamplingMetadata:
    n = len(params)
    penalties = None
    if any(p.uses_penalties for p in params):
        empty: list[list[int]] = [[] for _ in range(n)]
        penalties = Penalties.from_ids(params, prompt_ids or empty, output_ids or empty, vocab_size, CPU)
    return SamplingMetadata.build(
        params, generators or [None] * n, banned_ids or [[] for _ in range(n)], vocab_size, CPU, penalties
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab_size, generator=seeded(seed)) * 3


def repeat_sample(params: SamplingParams, logits: torch.Tensor, draws: int, seed: int = 0) -> torch.Tensor:
    """Sample one row `draws` times in a single batch of identical rows."""
    batch = logits.expand(draws, -1).contiguous()
    return Sampler(seeded(seed))(batch, build([params] * draws, logits.shape[-1])).token_ids


def test_greedy_is_argmax_and_skips_random_work() -> None:
    logits = random_logits(6, 50)
    generator = seeded(0)
    state = generator.get_state()
    meta = build([SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 6, 50)
    out = Sampler(generator)(logits, meta)
    assert meta.all_greedy
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert torch.equal(generator.get_state(), state)
    assert out.logprobs is None and out.logprob_token_ids is None and out.ranks is None


def test_top_k_1_equals_greedy_in_a_mixed_batch() -> None:
    logits = random_logits(8, 50)
    params = [SamplingParams(top_k=1, temperature=t) for t in (0.3, 1.0, 2.5, 7.0)]
    params += [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 2
    meta = build(params, 50)
    assert not meta.all_greedy
    sampler = Sampler(seeded(1))
    for _ in range(20):
        ids = sampler(logits, meta).token_ids
        picked = [0, 1, 2, 3, 4, 6]  # rows 5 and 7 sample freely
        assert torch.equal(ids[picked], logits[picked].argmax(-1))


def test_seeded_row_is_independent_of_the_batch() -> None:
    check_seeded_row_is_independent(None, CPU)


def test_top_k_stays_in_top_k() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5, 0.0, 1.8, -0.5, 1.0]])
    ids = repeat_sample(SamplingParams(top_k=3, temperature=2.0), logits, 4000)
    assert set(ids.tolist()) == {1, 3, 5}


def test_top_p_stays_in_nucleus() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15]])
    # Sorted: 0.4, 0.3 (cumulative 0.7 >= 0.65), so the nucleus is {1, 3}.
    ids = repeat_sample(SamplingParams(top_p=0.65), probs.log(), 4000)
    assert set(ids.tolist()) == {1, 3}
    # The top token is kept even when it alone exceeds top_p.
    assert set(repeat_sample(SamplingParams(top_p=0.01), probs.log(), 500).tolist()) == {1}


def test_min_p_drops_unlikely_tokens() -> None:
    probs = torch.tensor([[0.1, 0.5, 0.25, 0.15]])
    # Threshold 0.4 * 0.5 = 0.2 keeps tokens 1 and 2.
    ids = repeat_sample(SamplingParams(min_p=0.4), probs.log(), 4000)
    assert set(ids.tolist()) == {1, 2}


def test_banned_ids_never_sampled() -> None:
    vocab_size, draws = 10, 3000
    logits = torch.arange(vocab_size, dtype=torch.float32).expand(draws, -1).contiguous()
    params = [SamplingParams(temperature=5.0)] * (draws - 1) + [SamplingParams(temperature=0.0)]
    banned = [[9, 8, 3, 12]] * draws  # 12 is outside the vocabulary and ignored
    ids = Sampler(seeded(0))(logits, build(params, vocab_size, banned_ids=banned)).token_ids
    assert not {3, 8, 9} & set(ids.tolist())
    assert ids[-1].item() == 7
    assert len(set(ids.tolist())) == 7


LOGITS = [2.0, 1.9, -1.0, 0.5, 1.8]
PROMPT = [3]
OUTPUT = [0, 0, 4]


@pytest.mark.parametrize(
    ("params", "banned", "expected"),
    [
        (SamplingParams(), [], [2.0, 1.9, -1.0, 0.5, 1.8]),
        # Seen tokens 0, 3, 4: positive logits divided by the penalty.
        (SamplingParams(repetition_penalty=1.5), [], [2.0 / 1.5, 1.9, -1.0, 0.5 / 1.5, 1.8 / 1.5]),
        # Token 0 was generated twice, token 4 once.
        (SamplingParams(frequency_penalty=0.06), [], [2.0 - 0.12, 1.9, -1.0, 0.5, 1.8 - 0.06]),
        (SamplingParams(presence_penalty=0.06), [], [2.0 - 0.06, 1.9, -1.0, 0.5, 1.8 - 0.06]),
        (SamplingParams(logit_bias={2: 3.5, 1: -0.5}), [], [2.0, 1.4, 2.5, 0.5, 1.8]),
        # Bias comes before the repetition penalty: token 3 is (0.5 + 1.6) / 1.5, not 0.5 / 1.5 + 1.6.
        (
            SamplingParams(
                repetition_penalty=1.5, frequency_penalty=0.1, presence_penalty=0.2, logit_bias={3: 1.6}
            ),
            [],
            [2.0 / 1.5 - 0.2 - 0.2, 1.9, -1.0, 2.1 / 1.5, 1.8 / 1.5 - 0.1 - 0.2],
        ),
        (SamplingParams(logit_bias={0: 5.0}), [0], [-math.inf, 1.9, -1.0, 0.5, 1.8]),
    ],
)
def test_penalties_and_bias_by_hand(params: SamplingParams, banned: list[int], expected: list[float]) -> None:
    logits = torch.tensor([LOGITS])
    greedy = msgspec.structs.replace(params, temperature=0.0)
    meta = build([greedy], 5, prompt_ids=[PROMPT], output_ids=[OUTPUT], banned_ids=[banned])
    want = torch.tensor([expected])
    torch.testing.assert_close(apply_penalties(logits.clone(), meta), want)
    assert Sampler()(logits, meta).token_ids.item() == want.argmax().item()


def test_penalty_argmax_changes() -> None:
    logits = torch.tensor([LOGITS, LOGITS, LOGITS, LOGITS, [-1.0, -1.2, -3.0, -2.0, -4.0]])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.06),
        SamplingParams(temperature=0.0, presence_penalty=0.06),
        # Negative logits of seen tokens are multiplied by the penalty.
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
    ]
    meta = build(params, 5, prompt_ids=[PROMPT] * 5, output_ids=[OUTPUT] * 5)
    assert Sampler()(logits, meta).token_ids.tolist() == [0, 1, 1, 0, 1]


def test_logprobs_are_raw_and_ranked() -> None:
    logits = random_logits(4, 30, seed=5)
    top = logits.argsort(-1, descending=True)
    # Row 0 bans its best token, so the sampled token is second; logprobs still come from the raw logits.
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.9, top_k=4, logprobs=1),
        SamplingParams(temperature=1.0),
    ]
    banned = [[top[0, 0].item()], [], [], []]
    meta = build(params, 30, banned_ids=banned)
    assert meta.want_logprobs and meta.max_logprobs == 3
    out = Sampler(seeded(0))(logits, meta)
    assert out.logprobs is not None and out.logprob_token_ids is not None and out.ranks is not None
    assert out.logprobs.shape == out.logprob_token_ids.shape == (4, 4)

    expected = torch.log_softmax(logits, -1)
    assert out.token_ids[0].item() == top[0, 1].item()
    assert out.ranks[0].item() == 2
    assert out.token_ids[1].item() == top[1, 0].item()
    assert out.ranks[1].item() == 1
    for row in range(4):
        token = out.token_ids[row].item()
        assert out.logprob_token_ids[row, 0].item() == token
        assert out.logprobs[row, 0].item() == expected[row, token].item()
        assert out.ranks[row].item() == 1 + int((expected[row] > expected[row, token]).sum())
        assert out.logprob_token_ids[row, 1:].tolist() == top[row, :3].tolist()
        torch.testing.assert_close(out.logprobs[row, 1:], expected[row, top[row, :3]], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(mode: str) -> None:
    """vLLM's --logprobs-mode: raw_logits the model's logits; processed_* the values the draw saw, after
    bans, bias, temperature, min-p, top-k and top-p (-inf where cut), as log-softmax or as logits."""
    logits = random_logits(3, 30, seed=7)
    top = logits.argsort(-1, descending=True)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, top_k=4, logprobs=5, logit_bias={int(top[1, 29]): 100.0}),
        SamplingParams(temperature=2.0, top_p=0.5, min_p=0.1, logprobs=2),
    ]
    banned = [[int(top[0, 0])], [], []]
    out = Sampler(seeded(1), logprobs_mode=mode)(logits.clone(), build(params, 30, banned_ids=banned))  # type: ignore[arg-type]
    assert out.logprobs is not None and out.logprob_token_ids is not None
    if mode == "raw_logits":
        expected = logits
    else:
        x = logits.clone()
        x[0, top[0, 0]] = float("-inf")
        x[1, top[1, 29]] += 100.0  # the bias makes the worst token the best, and top-k keeps it
        x[1] /= 0.5
        x[2] /= 2.0
        x[1, x[1].argsort(descending=True)[4:]] = float("-inf")
        min_p = x[2].softmax(-1) < 0.1 * x[2].softmax(-1).max()
        x[2, min_p] = float("-inf")
        x[2:] = _top_k_top_p(x[2:], None, torch.tensor([0.5]))
        expected = x if mode == "processed_logits" else x.log_softmax(-1)
        assert int((expected[1] > float("-inf")).sum()) == 4
    for row in range(3):
        ids = out.logprob_token_ids[row]
        assert ids[0] == out.token_ids[row]
        torch.testing.assert_close(out.logprobs[row], expected[row, ids], rtol=1e-6, atol=1e-6)
    if mode != "raw_logits":  # the draw keeps to what the values say
        assert all(expected[r, out.token_ids[r]] > float("-inf") for r in range(3))
        assert out.logprobs[1, 5].item() == float("-inf")  # the 5th best of row 1 was cut by its top-k


def test_logprobs_zero_returns_only_the_sampled_token() -> None:
    logits = random_logits(2, 30)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=0)] * 2, 30))
    assert out.logprobs is not None and out.logprobs.shape == (2, 1)
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1).amax(-1), rtol=0, atol=0)


def test_compute_logprobs_ties_and_order() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [1.0, 3.0, 3.0, 0.0]])
    ids, logprobs, ranks = compute_logprobs(logits, torch.tensor([2, 0]), 2)
    assert ranks.tolist() == [1, 3]  # a tie with the best token still ranks 1
    assert ids[:, 0].tolist() == [2, 0]
    assert set(ids[0, 1:].tolist()) == {1, 2}
    expected = torch.log_softmax(logits, -1)
    assert torch.equal(logprobs, expected.gather(1, ids))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5, 1.5]])
    draws = 30_000
    ids = repeat_sample(SamplingParams(temperature=temperature), logits, draws, seed=123)
    observed = torch.bincount(ids, minlength=6).double()
    expected = torch.softmax(logits[0].double() / temperature, -1) * draws
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    # 5 degrees of freedom: P(chi2 > 25) is about 1e-4; the draw is fixed by the seed.
    assert chi2 < 25


def test_seeded_rows_follow_softmax_too() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    draws = 3000
    params = [SamplingParams(seed=i) for i in range(draws)]
    meta = build(params, 3, generators=[seeded(i) for i in range(draws)])
    ids = Sampler()(logits.expand(draws, -1).contiguous(), meta).token_ids
    observed = torch.bincount(ids, minlength=3).double()
    expected = torch.softmax(logits[0].double(), -1) * draws
    assert ((observed - expected) ** 2 / expected).sum().item() < 20


def test_logit_bias_outside_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        build([SamplingParams(logit_bias={10: 1.0})], 10)


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), CASES)
def test_sampling_distribution_follows_vllm_order(top_k: int, top_p: float, min_p: float) -> None:
    check_distribution(None, CPU, top_k, top_p, min_p)


def test_filter_order_matters_in_the_cases_checked() -> None:
    """The cases tell the orders apart: top-p on un-renormalised top-k, or min-p after top-p (vLLM V0's
    order, which kiln followed before), keep other tokens."""
    logits = torch.randn(20, generator=torch.Generator().manual_seed(0)) * 1.5
    probs = logits.double().softmax(-1)
    ranked = probs.sort(descending=True).values
    unrenormalised = ((ranked.cumsum(0) - ranked) < 0.8)[:6].sum()
    assert (expected_probs(logits, 6, 0.8, 0.0) > 0).sum() != unrenormalised
    nucleus = ranked[(ranked.cumsum(0) - ranked) < 0.8]
    min_p_after = (nucleus >= 0.1 * nucleus[0]).sum()
    assert (expected_probs(logits, 0, 0.8, 0.1) > 0).sum() != min_p_after


def test_the_cpu_draw_among_candidates_keeps_the_sorted_cut() -> None:
    """On a CPU the top-k/top-p cut is found among each row's largest logits, widening, and a row ranked
    whole only when its nucleus lies past them all; the row draws among the ranks it kept. Every token drawn
    lies in the cut a sort of the whole row keeps (ties kept lowest id first), the most likely and the least
    likely kept token are drawn at the ends of the uniform range, and a row draws the same alone as in its
    batch (whose top-k may widen the candidates)."""
    g = torch.Generator().manual_seed(0)
    vocab = 6000
    x = torch.randn(8, vocab, generator=g) * 2
    x[0] = x[0].round()  # ties at the cut and within it
    x[1, ::2] = float("-inf")
    x[2] = 0.01 * torch.randn(vocab, generator=g)  # flat: top-p 0.95 keeps 5,694 ranks, past 4,096
    x[3] = torch.randn(vocab, generator=g) * 1.5  # top-p 0.9 keeps 2,444: past 256 ranks, within 4,096
    x[4] = torch.randn(vocab, generator=g) * 0.5  # top-k 300 and top-p 0.5 within it
    k = torch.tensor([7, vocab, vocab, vocab, 300, 40, vocab, 1])
    p = torch.tensor([0.9, 0.8, 0.95, 0.9, 0.5, 1.0, 1.0, 0.3])
    ends = (torch.zeros(len(x)), torch.full((len(x),), 1 - 2**-24))
    for top_k, top_p in ((k, p), (None, p), (k, None)):
        kept = ~_top_k_top_p(x.clone(), top_k, top_p).isinf()
        if top_p is not None:
            assert kept.sum(-1)[2:4].tolist() == [5694, 2444]
        for u in (*ends, torch.rand(len(x), generator=g)):
            drawn = _draw_among_candidates(x.clone(), top_k, top_p, u)
            assert kept.gather(1, drawn[:, None]).all()
            for row in range(len(x)):
                k_row = None if top_k is None else top_k[row : row + 1]
                p_row = None if top_p is None else top_p[row : row + 1]
                alone = _draw_among_candidates(x[row : row + 1].clone(), k_row, p_row, u[row : row + 1])
                assert alone.item() == drawn[row].item()
        first, final = (_draw_among_candidates(x.clone(), top_k, top_p, u) for u in ends)
        # A row without a filter draws over the whole row, in id order.
        cut = [
            r
            for r in range(1, len(x))
            if (top_k is not None and k[r] < vocab) or (top_p is not None and p[r] < 1)
        ]
        assert first[cut].tolist() == x[cut].argmax(-1).tolist()
        # The least likely kept token (its mass well above float32's rounding of the total here), where
        # it is one token: rows 0 (ties) and 2 (flat) aside.
        least = x.masked_fill(~kept, float("inf")).argmin(-1)
        spread = x.amax(-1) - x.gather(1, least[:, None])[:, 0]
        rows = [r for r in cut if r != 2 and spread[r] < 8]
        assert len(rows) >= 3 and final[rows].tolist() == least[rows].tolist()
