"""Speculative decoding by prompt lookup (vLLM's ngram method): the index proposes what a whole-sequence
search proposes; greedy outputs, their logprobs and every way of ending equal decoding one token a step;
sampled outputs keep the model's distribution."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from kiln.engine.speculative import Drafter, NgramIndex
from kiln.speculative_config import SpeculativeConfig
from tests.engine.test_async_scheduling import whole
from tests.models.tiny import build_default_vocab
from tests.sampling_expectation import chi_square_critical

OPTIONS = {"dtype": "float32", "max_model_len": 256, "kv_cache_gib": 0.05, "max_num_batched_tokens": 64}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def search(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's proposal, by brute force: the longest n-gram ending the sequence that occurs earlier, at its
    earliest occurrence; the k tokens after it."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[total - n :] if n <= total else None
        for start in range(total - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(1, 1, 3), (1, 3, 4), (2, 5, 2), (5, 5, 5)])
def test_the_index_proposes_what_a_whole_sequence_search_does(min_n: int, max_n: int, k: int) -> None:
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(20):
        tokens: list[int] = []
        index = NgramIndex(min_n, max_n)
        for _ in range(60):
            tokens += rng.choices(range(4), k=rng.choice([1, 1, 3]))  # several tokens a step, sometimes
            assert index.propose(tokens, k) == search(tokens, min_n, max_n, k), tokens


def test_speculative_config_follows_vllm() -> None:
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig(model="[ngram]", num_speculative_tokens=3)
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 5)
    c = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=5,
        num_speculative_tokens_per_batch_size=[(9, 64, 1), (1, 1, 7), (2, 4, 3)],
    )
    assert c.num_speculative_tokens_per_batch_size == [(1, 1, 7), (2, 4, 3), (9, 64, 1)]
    drafter = Drafter(c)
    assert [drafter.k_for(b) for b in (1, 2, 4, 5, 8, 9, 64, 65)] == [5, 3, 3, 3, 3, 1, 1, 1]  # k caps it
    for bad, message in [
        ({"method": "eagle", "num_speculative_tokens": 3}, "speculative method 'eagle' is not built"),
        ({"method": "ngram", "num_speculative_tokens": 2,
          "num_speculative_tokens_per_batch_size": [(2, 8, 1)]},
         "The first batch-size range must start at 1"),
        ({"method": "ngram", "num_speculative_tokens": 2,
          "num_speculative_tokens_per_batch_size": [(1, 8, 1), (8, 9, 1)]},
         "Batch-size ranges must be non-overlapping"),
        ({"method": "ngram"}, "num_speculative_tokens is needed"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig(**bad)


@pytest.fixture(scope="module")
def engines(default_model_dir: Path) -> dict[bool, LLM]:
    return {
        s: LLM(str(default_model_dir), speculative_config=SPEC if s else None, **OPTIONS)
        for s in (False, True)
    }


@pytest.mark.slow
def test_every_way_of_ending_matches_one_token_a_step(engines: dict[bool, LLM]) -> None:
    llm = engines[True]
    tok = llm.get_tokenizer()
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    copy = llm.apply_chat_template([{"role": "user", "content": "Repeat exactly:\n" + code * 2}])
    text = tok.encode("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the")
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    first = llm.generate([copy], greedy, use_tqdm=False)[0].outputs[0]
    cases = [
        (copy, greedy),  # ends at EOS
        (copy, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=12)),  # no drafts for 12 tokens
        (copy, SamplingParams(temperature=0.0, max_tokens=40, stop=[tok.decode(first.token_ids[9:11])])),
        (copy, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[first.token_ids[7]])),
        (text, SamplingParams(temperature=0.0, max_tokens=1)),
        (text, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2, prompt_logprobs=1)),
        (text, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)),
        # Penalties: each row counts the drafts before it (a seeded draw would differ: rows take uniforms).
        (copy, SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, presence_penalty=0.5)),
        (text[:5], SamplingParams(temperature=0.0, max_tokens=256)),  # ends at max_model_len
        (text, SamplingParams(temperature=0.0, max_tokens=20, bad_words=["lazy dog"])),  # none
        (text, SamplingParams(temperature=0.0, max_tokens=20, bad_words=["fox"])),  # one token: drafts
    ]
    prompts, params = [p for p, _ in cases], [q for _, q in cases]
    plain, drafted = (engines[s].generate(prompts, params, use_tqdm=False) for s in (False, True))
    reasons = [c.finish_reason for out in plain for c in out.outputs]
    assert reasons.count("stop") >= 3 and reasons.count("length") >= 4
    for p, d in zip(plain, drafted, strict=True):
        assert whole(d) == whole(p)
    drafts = llm.engine.drafts
    assert drafts is not None and 0 < drafts.num_accepted_tokens < drafts.num_draft_tokens
    assert drafts.accepted_per_pos[0] >= drafts.accepted_per_pos[-1] > 0
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.usage == 0.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> str:
    """A random model, whose flat distributions have drafts both kept and refused often."""
    return str(build_default_vocab(tmp_path_factory.mktemp("tiny-spec"), default_model_dir))


@pytest.fixture(scope="module")
def tiny_engines(tiny_model: str) -> dict[bool, LLM]:
    return {
        s: LLM(tiny_model, speculative_config=SPEC if s else None, enforce_eager=True) for s in (False, True)
    }


def test_drafts_follow_the_batch_size_schedule(tiny_model: str) -> None:
    """vLLM's num_speculative_tokens_per_batch_size: one running request drafts up to 3 tokens a step,
    two or three up to 1, four or more none."""
    schedule = [[1, 1, 3], [2, 3, 1], [4, 64, 0]]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "num_speculative_tokens_per_batch_size": schedule}  # fmt: skip
    llm = LLM(tiny_model, speculative_config=spec, enforce_eager=True)
    prompt = llm.get_tokenizer().encode("red green blue red green blue red green")
    params = SamplingParams(
        temperature=0.0, max_tokens=9, ignore_eos=True, allowed_token_ids=sorted(set(prompt))
    )
    engine, most = llm.engine, []
    assert engine.drafts is not None
    for batch in (1, 2, 4):
        for i in range(batch):
            engine.add_request(f"{batch}-{i}", prompt, params)
        drafted = []  # each step's drafts, all requests'
        while engine.has_unfinished():
            before = engine.drafts.num_draft_tokens
            engine.step()
            drafted.append(engine.drafts.num_draft_tokens - before)
        most.append(max(drafted))
    assert most == [3, 2 * 1, 0]


@pytest.mark.parametrize(
    ("penalties", "max_tokens"), [({}, 4), ({"repetition_penalty": 1.5, "frequency_penalty": 0.6}, 6)]
)
def test_sampled_tokens_keep_the_models_distribution(
    tiny_engines: dict[bool, LLM], penalties: dict, max_tokens: int
) -> None:
    """Where a draft is kept with the probability the model gives it, and otherwise a token is drawn
    without it, the tokens are distributed as drawn one at a time: the counts of short replies, with drafts
    and without, pass a chi-square test of homogeneity (p = 0.001). Without penalties, of each 4-token
    reply; with them, of how often each word occurs in a 6-token reply (what penalties act on): a row
    counts the drafts before it, and a step counts only the tokens kept."""
    llm = tiny_engines[True]
    prompt = llm.get_tokenizer().encode("red green blue red green blue red green blue red green")
    # Replies of " red", " green" and " blue": the prompt always holds a match for their last token.
    words = sorted(set(prompt[1:]))
    params = SamplingParams(
        temperature=1.0, max_tokens=max_tokens, ignore_eos=True, allowed_token_ids=words, **penalties
    )

    def reply(ids: list[int]) -> tuple[int, ...]:
        return tuple(ids) if not penalties else tuple(ids.count(w) for w in words)

    assert llm.engine.drafts is not None
    before = llm.engine.drafts.num_draft_tokens, llm.engine.drafts.num_accepted_tokens
    counts = {
        s: Counter(reply(o.outputs[0].token_ids) for o in e.generate([prompt] * 3000, params, use_tqdm=False))
        for s, e in tiny_engines.items()
    }
    drafted = llm.engine.drafts.num_draft_tokens - before[0]
    kept = llm.engine.drafts.num_accepted_tokens - before[1]
    assert drafted > 1000 and 300 < kept < drafted - 300
    # Replies seen fewer than 10 times in all share one cell, so that every cell expects enough.
    pooled = counts[False] + counts[True]
    cells = [r for r, c in pooled.items() if c >= 10]

    def observed(c: Counter) -> list[int]:
        return [c[r] for r in cells] + [sum(n for r, n in c.items() if pooled[r] < 10)]

    stat = 0.0
    for s in (False, True):
        for seen, both in zip(observed(counts[s]), observed(pooled), strict=True):
            expected = both / 2  # the two samples are the same size
            stat += (seen - expected) ** 2 / expected if expected else 0.0
    assert len(words) == 3 and len(cells) >= 15
    assert stat < chi_square_critical(len(cells)), (stat, len(cells))
