"""A workload that reaches every step shape serving can produce, and the check that running it after
warmup compiled nothing (by torch's own counters). Shared by the CPU test and tests/gpu."""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kiln import LLM, SamplingParams
from kiln.compile.reports import compile_counters
from kiln.engine.dummy_steps import DummySteps
from kiln.ops.sampling_metadata import SamplingMetadata

MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 64
OPTIONS = {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS}


def _prompt(n: int, start: int = 1) -> list[int]:
    return [(start + 7 * i) % 200 + 1 for i in range(n)]


def varied_workload(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for n in (1, 2, 3, 17, 40):  # one request alone: mixed steps of one request, then decode 1
        llm.generate([_prompt(n)], greedy, use_tqdm=False)
    # Many at once, finishing at different times: mixed steps of many requests, then every decode size.
    many = [_prompt(n, n) for n in range(3, 3 + 2 * MAX_NUM_SEQS, 2)]
    lengths = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True) for i in range(len(many))]
    llm.generate(many, lengths, use_tqdm=False)
    # Longer than a step's token budget: chunked prefill; the same prompt again hits the prefix cache.
    long = _prompt(3 * MAX_NUM_BATCHED_TOKENS + 5)
    llm.generate([long], greedy, use_tqdm=False)
    llm.generate([long, long[:100] + _prompt(9)], greedy, use_tqdm=False)
    # Every sampling path: filters, penalties, seeds, several samples, logprobs.
    sampled = [
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, max_tokens=5, seed=1),
        SamplingParams(temperature=1.0, max_tokens=5, repetition_penalty=1.2, presence_penalty=0.5),
        SamplingParams(temperature=0.7, top_p=0.8, max_tokens=5, n=3, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=1.0, min_p=0.1, max_tokens=5, logit_bias={3: 2.0}),
    ]
    llm.generate([_prompt(11, 5)] * len(sampled), sampled, use_tqdm=False)
    llm.generate([_prompt(11, 5)], sampled[0], use_tqdm=False)  # sampled rows and no penalty in the step
    if llm.engine.drafts is not None:  # speculative decoding: drafts of every length, many requests' at once
        loop = [5, 6, 7, 8] * 6
        words = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=[5, 6, 7, 8])
        llm.generate([loop[i:] for i in range(MAX_NUM_SEQS)], words, use_tqdm=False)
        llm.generate([loop], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), use_tqdm=False)


@contextlib.contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """The Triton kernels built meanwhile (compiled, or loaded from Triton's disk cache) by a launch outside
    Inductor's graphs: one per kernel and specialization that warmup did not build. None under Triton's
    interpreter, which builds nothing."""
    from triton import knobs

    built: list[str] = []

    def hook(*, fn: Any, **_: Any) -> None:
        built.append(fn.name)

    previous, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, hook
    try:
        yield built
    finally:
        knobs.runtime.jit_post_compile_hook = previous


@contextlib.contextmanager
def prep_kinds(llm: LLM) -> Iterator[set[tuple[bool, bool, bool]]]:
    """Which of penalties, logit bias and banned ids the sampler's prepare step was given meanwhile. Triton
    builds its prep kernel apart for each combination (an argument that is None is a constant to it), which
    the CPU, whose interpreter builds nothing, can only check this way."""
    sampler = llm.engine.runner.sampler
    prepare, kinds = sampler.prepare, set()

    def spy(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        kinds.add((meta.penalties is not None, meta.logit_bias is not None, meta.banned is not None))
        return prepare(logits, meta)

    sampler.prepare = spy
    try:
        yield kinds
    finally:
        sampler.prepare = prepare


def assert_nothing_compiles_after_ready(llm: LLM) -> None:
    with prep_kinds(llm) as warmed:
        DummySteps(llm.engine.runner).warm_sampler()  # as warmup ran it, on a generator of its own
    before = compile_counters()
    with triton_compiles() as built, prep_kinds(llm) as served:
        varied_workload(llm)
    after = compile_counters()
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not built, f"Triton kernels built after ready: {built}"
    assert served <= warmed, f"prep steps warmup never ran: {served - warmed}"
    assert llm.engine.runner.lowering.misses == 0
