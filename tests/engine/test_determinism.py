"""Same request, same answer: on the CPU, with the default config, a request's greedy tokens and its seeded
sampled tokens do not depend on the prefix cache, on where chunked prefill splits its prompt, on the other
requests in its steps, or on a preemption and recompute."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from tests.models.tiny import VOCAB, build

pytestmark = pytest.mark.slow

TOKENS = 64
CHATS = [
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "Give me three tips for learning to cook.",
]
COMPLETIONS = [
    "The history of the lighthouse begins",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the mountains,",
]
LONG = 2100  # prompt tokens of a long neighbour: more than the 2048-token step budget, so it is chunked

Target = tuple[list[int], SamplingParams]


def targets(llm: LLM) -> list[Target]:
    tok = llm.get_tokenizer()
    prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    prompts += [tok.encode(c) for c in COMPLETIONS]
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    out: list[Target] = []
    for i, ids in enumerate(prompts):
        out.append((ids, greedy))
        out.append((ids, SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=TOKENS, ignore_eos=True)))
    return out


def neighbours(rng: random.Random, count: int, vocab: int, long: int = 0) -> list[Target]:
    """Random prompts (their own tokens, so they share no prefix with a target) and sampling settings."""
    out: list[Target] = []
    for i in range(count):
        length = LONG if i < long else rng.randint(4, 300)
        ids = [rng.randrange(vocab) for _ in range(length)]
        temp = rng.choice([0.0, 0.7, 1.0])
        out.append((ids, SamplingParams(temperature=temp, max_tokens=rng.randint(4, 80), ignore_eos=True)))
    return out


def run(llm: LLM, batch: Sequence[Target]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": ids} for ids, _ in batch]
    outs = llm.generate(prompts, [p for _, p in batch], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # The default config: compiled, prefix caching on, and `auto` dtype: bfloat16 multiplied natively on
    # a CPU with AVX512-BF16, else float16 widened to float32.
    return LLM("default")


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[list[int]]:
    """Each target's tokens when it runs by itself, first seen (its prefix not cached)."""
    return [run(llm, [t])[0] for t in targets(llm)]


def test_repeats_with_the_prefix_cached_give_the_same_tokens(llm: LLM, alone: list[list[int]]) -> None:
    before = llm.engine.stats()["prefix_cache_hits"]
    assert [run(llm, [t])[0] for t in targets(llm)] == alone
    assert llm.engine.stats()["prefix_cache_hits"] > before


@pytest.mark.parametrize("size", [4, 16])
def test_batches_with_chunked_neighbours_give_the_same_tokens(
    llm: LLM, alone: list[list[int]], size: int
) -> None:
    """In every other batch a long neighbour goes first, so it is chunked and the targets' prompts are split
    at whatever the step budget leaves; the other neighbours are random in length, sampling and output
    length."""
    rng = random.Random(size)
    vocab = llm.engine.model.dims.vocab_size
    tgts = list(enumerate(targets(llm)))
    per_batch = 2 if size == 4 else 6
    for start in range(0, len(tgts), per_batch):
        group = tgts[start : start + per_batch]
        long = 1 if start % (2 * per_batch) == 0 else 0  # every other batch: each long prefill takes seconds
        fill = neighbours(rng, size - len(group), vocab, long)
        batch: list[tuple[int | None, Target]] = [(i, t) for i, t in group] + [(None, n) for n in fill[long:]]
        rng.shuffle(batch)
        if long:
            batch.insert(0, (None, fill[0]))
        got = run(llm, [t for _, t in batch])
        for (i, _), tokens in zip(batch, got, strict=True):
            if i is not None:
                assert tokens == alone[i], f"target {i} changed in a batch of {size}"


def test_preemption_and_recompute_give_the_same_tokens(alone: list[list[int]]) -> None:
    # About 900 tokens of KV cache: sixteen requests of up to 300 + 64 tokens cannot all fit at once.
    small = LLM("default", kv_cache_gib=0.02, max_model_len=512)
    rng = random.Random(7)
    tgts = targets(small)
    batch = tgts + neighbours(rng, 16 - len(tgts), small.engine.model.dims.vocab_size)
    got = run(small, batch)
    assert small.engine.stats()["preemptions"] > 0
    assert got[: len(tgts)] == alone


@pytest.fixture(scope="module")
def llm32() -> LLM:
    return LLM("default", dtype="float32", max_model_len=1024)


def at_concurrency(llm: LLM, batch: Sequence[Target], concurrency: int) -> list[list[int]]:
    """Each target's tokens when `concurrency` requests are in flight, as a serving client keeps them:
    a new one starts as soon as one finishes, so requests join and leave batches mid-decode."""
    engine, pending, done = llm.engine, list(enumerate(batch)), {}
    while pending or engine.has_unfinished():
        while pending and len(pending) + len(done) + concurrency > len(batch):
            i, (ids, params) = pending.pop(0)
            engine.add_request(f"c{concurrency}-{i}", ids, params)
        for out in engine.step(final_only=True):
            done[int(out.request_id.split("-")[1])] = list(out.outputs[0].token_ids)
    return [done[i] for i in range(len(batch))]


@pytest.fixture(scope="module")
def varied32(llm32: LLM) -> list[Target]:
    """16 greedy requests of different prompt and output lengths, some sharing a cached prefix."""
    rng = random.Random(3)
    tok = llm32.get_tokenizer()
    texts = [*CHATS, *COMPLETIONS]
    batch: list[Target] = []
    for i in range(16):
        ids = tok.encode(texts[i % len(texts)]) + [
            rng.randrange(100, 10_000) for _ in range(rng.randint(0, 60))
        ]
        batch.append((ids, SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 40), ignore_eos=True)))
    return batch


@pytest.fixture(scope="module")
def alone32(llm32: LLM, varied32: list[Target]) -> list[list[int]]:
    return [run(llm32, [t])[0] for t in varied32]


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_greedy_tokens_at_any_concurrency_equal_batch_1_in_float32(
    llm32: LLM, varied32: list[Target], alone32: list[list[int]], concurrency: int
) -> None:
    assert at_concurrency(llm32, varied32, concurrency) == alone32


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_logprobs_alone_equal_those_in_any_batch(arch: str, dtype: str, tmp_path: Path) -> None:
    """A MoE layer's experts get the rows the whole step routes to them; a request's logprobs, to the bit,
    still do not depend on which other requests share its steps."""
    build(arch, tmp_path)
    llm = LLM(str(tmp_path), dtype=dtype, kv_cache_gib=0.05)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    target = [5, 17, 33, 2, 90, 41, 7, 8, 9, 10, 11]

    def logprobs(batch: list[list[int]], at: int) -> list[dict[int, float]]:
        out = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)[at].outputs[0]
        return [{t: lp.logprob for t, lp in d.items()} for d in out.logprobs]

    alone = logprobs([target], 0)
    rng = random.Random(0)
    for _ in range(4):
        others = [
            [rng.randrange(VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(rng.randint(1, 12))
        ]
        at = rng.randint(0, len(others))
        assert logprobs([*others[:at], target, *others[at:]], at) == alone
