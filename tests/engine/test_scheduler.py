"""Scheduler unit tests, driven by fake steps (no model): the engine's bookkeeping is done by hand."""

from __future__ import annotations

import itertools
import random

import pytest

from kiln.config import SchedulerConfig
from kiln.engine.block_manager import BlockManager
from kiln.engine.request import Request, Status
from kiln.engine.scheduler import ScheduledBatch, Scheduler
from kiln.engine.speculative import Drafter
from kiln.lora_request import LoRARequest
from kiln.sampling_params import SamplingParams
from kiln.speculative_config import SpeculativeConfig

BS = 4
_fresh = itertools.count(10_000)  # distinct token ids, so unrelated prompts never share a cached block


def make_request(rid: str, prompt: list[int] | int, max_tokens: int = 16, priority: int = 0) -> Request:
    token_ids = [next(_fresh) for _ in range(prompt)] if isinstance(prompt, int) else list(prompt)
    return Request(
        request_id=rid,
        parent_id=rid,
        params=SamplingParams(max_tokens=max_tokens),
        token_ids=token_ids,
        num_prompt_tokens=len(token_ids),
        max_tokens=max_tokens,
        text=None,  # type: ignore[arg-type]
        priority=priority,
    )


def make_scheduler(
    num_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    caching: bool = True,
    chunk: int = 0,  # the most tokens a request prefills in a step; 0: the step budget
    chunked: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, BlockManager(num_blocks, BS, caching), chunk or max_num_batched_tokens)


def check_invariants(sched: Scheduler, batch: ScheduledBatch) -> None:
    bm = sched.block_manager
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert all(n >= 1 for n in batch.num_new_tokens)
    assert len({id(r) for r in batch.requests}) == len(batch.requests)
    for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
        assert req.status is Status.RUNNING and req in sched.running
        assert req.num_computed_tokens + n <= req.num_tokens
        assert len(req.block_ids) * BS >= req.num_computed_tokens + n
    for req in sched.waiting:
        assert req.status is Status.WAITING
        assert req.block_ids == [] and req.num_computed_tokens == 0
    # Every block reference is held by exactly one running request's table.
    held: dict[int, int] = {}
    for req in sched.running:
        for b in req.block_ids:
            held[b] = held.get(b, 0) + 1
    assert {b: n for b, n in enumerate(bm.ref_counts) if n} == held
    assert bm.num_free == bm.num_blocks - len(held)
    assert set(bm.free).isdisjoint(held)
    assert all(b < bm.next_unused for b in held)


def step(sched: Scheduler, next_token: int = 7) -> ScheduledBatch:
    """What LLMEngine.step does around the model: advance computed tokens, sample, finish."""
    batch = sched.schedule()
    check_invariants(sched, batch)
    for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
        req.num_computed_tokens += n
        sched.block_manager.cache_full_blocks(req)
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(next_token)
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req)
    return batch


def scheduled(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)]


def test_long_prompt_is_prefilled_in_chunks_within_the_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    req = make_request("a", 21, max_tokens=3)
    sched.add(req)
    assert scheduled(step(sched)) == [("a", 8)]
    assert req.num_computed_tokens == 8 and req.num_output_tokens == 0
    assert scheduled(step(sched)) == [("a", 8)]
    assert req.num_output_tokens == 0
    assert scheduled(step(sched)) == [("a", 5)]  # the last chunk samples the first token
    assert req.num_output_tokens == 1
    assert scheduled(step(sched)) == [("a", 1)]
    assert scheduled(step(sched)) == [("a", 1)]
    assert req.finished and not sched.has_unfinished()
    assert sched.block_manager.num_free == sched.block_manager.num_blocks


def test_running_decodes_go_first_and_new_prefills_fill_the_rest_of_the_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b, c = make_request("a", 6), make_request("b", 9), make_request("c", 4)
    for r in (a, b, c):
        sched.add(r)
    assert scheduled(step(sched)) == [("a", 6), ("b", 4)]
    assert scheduled(step(sched)) == [("a", 1), ("b", 5), ("c", 4)]
    assert scheduled(step(sched)) == [("a", 1), ("b", 1), ("c", 1)]
    d = make_request("d", 30)
    sched.add(d)
    assert scheduled(step(sched)) == [("a", 1), ("b", 1), ("c", 1), ("d", 7)]
    assert scheduled(step(sched)) == [("a", 1), ("b", 1), ("c", 1), ("d", 7)]


def test_budget_also_limits_running_prefills() -> None:
    sched = make_scheduler(max_num_batched_tokens=6)
    a, b = make_request("a", 10), make_request("b", 10)
    sched.add(a)
    sched.add(b)
    assert scheduled(step(sched)) == [("a", 6)]
    assert scheduled(step(sched)) == [("a", 4), ("b", 2)]
    assert scheduled(step(sched)) == [("a", 1), ("b", 5)]
    assert scheduled(step(sched)) == [("a", 1), ("b", 3)]
    assert scheduled(step(sched)) == [("a", 1), ("b", 1)]


def test_long_prefill_threshold_chunks_a_long_prompt_and_a_short_one_overtakes_it() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, chunk=4)
    long = make_request("long", 14, max_tokens=2)
    sched.add(long)
    assert scheduled(step(sched)) == [("long", 4)]  # the threshold, not the budget, limits its chunk
    short = make_request("short", 3, max_tokens=2)
    sched.add(short)
    assert scheduled(step(sched)) == [("long", 4), ("short", 3)]
    assert short.num_output_tokens == 1 and long.num_output_tokens == 0
    assert scheduled(step(sched)) == [("long", 4), ("short", 1)]
    assert scheduled(step(sched)) == [("long", 2)]
    assert long.num_output_tokens == 1 and short.finished


def test_many_short_prompts_fill_the_step_beside_a_chunked_long_one() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, chunk=4)
    reqs = [make_request("long", 20, max_tokens=2)] + [
        make_request(f"s{i}", 3, max_tokens=2) for i in range(5)
    ]
    for r in reqs:
        sched.add(r)
    # No limit on how many requests prefill at once: only the budget (16) and each one's chunk (4).
    assert scheduled(step(sched)) == [("long", 4), ("s0", 3), ("s1", 3), ("s2", 3), ("s3", 3)]
    assert scheduled(step(sched)) == [("long", 4), ("s0", 1), ("s1", 1), ("s2", 1), ("s3", 1), ("s4", 3)]


def test_long_prompts_that_arrive_together_take_their_share_oldest_first() -> None:
    """Four long prompts share four chunks of a step, as vLLM's threshold gives them, but the oldest takes
    them first: its first token comes after one step, not all four after three."""
    sched = make_scheduler(max_num_batched_tokens=16, chunk=4)
    reqs = [make_request(rid, 12, max_tokens=2) for rid in "abcd"]
    for r in reqs:
        sched.add(r)
    assert scheduled(step(sched)) == [("a", 12), ("b", 4)]
    assert [r.num_output_tokens for r in reqs] == [1, 0, 0, 0]
    assert sched.num_deferred == 0  # c and d wait their turn: not deferred
    # b is the one long prefill left running, c and d wait: three chunks, b's need first.
    assert scheduled(step(sched)) == [("a", 1), ("b", 8), ("c", 4)]
    assert scheduled(step(sched)) == [("b", 1), ("c", 8)]  # two long prompts: two chunks
    # The last one alone gets a chunk a step, as before, so that a short prompt would start beside it.
    assert scheduled(step(sched)) == [("c", 1), ("d", 4)]
    assert scheduled(step(sched)) == [("d", 4)]


def test_a_short_prompt_starts_beside_a_long_one_waiting_its_turn() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, chunk=4)
    for r in [make_request("l1", 12, max_tokens=2), make_request("l2", 12, max_tokens=2)]:
        sched.add(r)
    sched.add(make_request("s", 3, max_tokens=2))
    # l1 takes both long prompts' chunks; l2 waits; the short prompt behind it starts.
    assert scheduled(step(sched)) == [("l1", 8), ("s", 3)]
    assert [r.request_id for r in sched.waiting] == ["l2"]


def test_default_chunk_is_128_on_the_cpu_and_the_budget_on_a_gpu() -> None:
    cpu, h100 = SchedulerConfig().on("cpu"), SchedulerConfig().on("cuda", 80 * 2**30, "NVIDIA H100")
    assert cpu.prefill_chunk("cpu") == 128
    assert cpu.prefill_chunk("cpu", tiles=True) == 1024
    assert h100.prefill_chunk("cuda") == 8192
    assert SchedulerConfig(long_prefill_token_threshold=0).on("cpu").prefill_chunk("cpu") == 2048
    assert SchedulerConfig(long_prefill_token_threshold=100).on("cuda").prefill_chunk("cuda") == 100


def test_without_chunked_prefill_a_prompt_waits_for_room_for_all_of_it() -> None:
    """vLLM's --no-enable-chunked-prefill: a prompt that does not fit what the step has left waits (and
    those behind it with it), rather than starting with a part."""
    sched = make_scheduler(max_num_batched_tokens=16, chunked=False)
    for rid, n in [("a", 10), ("b", 10), ("c", 2)]:
        sched.add(make_request(rid, n, max_tokens=4))
    assert scheduled(step(sched)) == [("a", 10)]  # b's 10 do not fit the 6 left, and c waits behind it
    assert scheduled(step(sched)) == [("a", 1), ("b", 10), ("c", 2)]
    chunked = make_scheduler(max_num_batched_tokens=16)
    for rid, n in [("a", 10), ("b", 10)]:
        chunked.add(make_request(rid, n, max_tokens=4))
    assert scheduled(step(chunked)) == [("a", 10), ("b", 6)]


def test_without_chunked_prefill_the_step_holds_max_model_len() -> None:
    whole = SchedulerConfig(enable_chunked_prefill=False)
    assert whole.on("cpu", max_model_len=8192).max_num_batched_tokens == 8192
    assert whole.on("cpu", max_model_len=8192).prefill_chunk("cpu") == 8192  # no threshold unless set
    assert whole.on("cpu", max_model_len=512).max_num_batched_tokens == 2048
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(1024\) is smaller than max_model_len \(4096\)"
    ):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=1024).on(
            "cpu", max_model_len=4096
        )


def test_max_num_seqs_limits_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", 3, max_tokens=2 + i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    assert scheduled(step(sched)) == [("r0", 3), ("r1", 3)]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    assert scheduled(step(sched)) == [("r0", 1), ("r1", 1)]
    assert reqs[0].finished  # two tokens: its slot frees up for r2
    assert scheduled(step(sched)) == [("r1", 1), ("r2", 3)]
    assert reqs[1].finished
    assert scheduled(step(sched)) == [("r2", 1), ("r3", 3)]
    while sched.has_unfinished():
        step(sched)
    assert all(r.finished and r.num_output_tokens == r.max_tokens for r in reqs)


def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    # 6 blocks: "big" (7 blocks) can never be admitted while "small" holds two; FCFS keeps the later,
    # smaller requests behind it instead of letting them overtake.
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    holder = make_request("holder", 5, max_tokens=2)
    big = make_request("big", 28, max_tokens=1)
    small = make_request("small", 3, max_tokens=1)
    for r in (holder, big, small):
        sched.add(r)
    assert scheduled(step(sched)) == [("holder", 5)]
    assert [r.request_id for r in sched.waiting] == ["big", "small"]
    assert big.block_ids == [] and big.num_computed_tokens == 0
    assert scheduled(step(sched)) == [("holder", 1)]
    assert holder.finished
    assert scheduled(step(sched)) == [("big", 28), ("small", 3)]


def test_preemption_recomputes_the_newest_running_request() -> None:
    # 4 blocks of 4 tokens: two requests of 5 tokens each hold two blocks; the first one to need a
    # third block forces the newest running request out.
    sched = make_scheduler(num_blocks=4)
    # Requests never outgrow the whole cache (the engine guarantees that through max_model_len).
    old, new = make_request("old", 5, max_tokens=8), make_request("new", 5, max_tokens=8)
    late = make_request("late", 2, max_tokens=2)
    sched.add(old)
    sched.add(new)
    assert scheduled(step(sched)) == [("old", 5), ("new", 5)]
    for _ in range(3):  # tokens 6..8 of each
        assert scheduled(step(sched)) == [("old", 1), ("new", 1)]
    sched.add(late)
    assert old.num_tokens == 9 and old.num_computed_tokens == 8
    new_blocks = list(new.block_ids)

    batch = step(sched)
    assert scheduled(batch) == [("old", 1)]
    assert batch.num_preempted == 1 and sched.num_preemptions == 1
    assert new.status is Status.WAITING
    assert new.num_computed_tokens == 0 and new.block_ids == []
    assert list(sched.waiting) == [new, late]  # back in front of later arrivals
    assert sched.running == [old]
    assert len(old.block_ids) == 3
    assert set(new_blocks) & set(old.block_ids)  # its freed blocks went to old
    assert new.num_tokens == 9  # generated tokens are kept; only the KV is dropped

    # It resumes (once there is room) by recomputing prompt and output, then samples its next token.
    while new.status is Status.WAITING:
        assert new.num_output_tokens == 4
        step(sched)
    assert old.finished
    assert new.num_computed_tokens == 9 and new.num_output_tokens == 5
    while sched.has_unfinished():
        step(sched)
    assert new.num_output_tokens == 8 and late.finished


def test_newest_request_preempts_itself_when_it_cannot_grow() -> None:
    sched = make_scheduler(num_blocks=3)
    old, new = make_request("old", 5), make_request("new", 4)
    sched.add(old)
    sched.add(new)
    assert scheduled(step(sched)) == [("old", 5), ("new", 4)]  # 2 blocks + 1 block: none left
    # old still has room in its second block; new needs a second block and is itself the newest.
    batch = step(sched)
    assert scheduled(batch) == [("old", 1)]
    assert batch.num_preempted == 1
    assert sched.running == [old] and list(sched.waiting) == [new]
    assert new.block_ids == [] and new.num_computed_tokens == 0 and new.num_tokens == 5
    assert len(old.block_ids) == 2 and sched.block_manager.num_free == 1


def test_priority_orders_admission_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1)
    reqs = [
        make_request("low", 3, max_tokens=1, priority=5),
        make_request("first", 3, max_tokens=1, priority=-1),
        make_request("middle", 3, max_tokens=1),
        make_request("second", 3, max_tokens=1, priority=-1),
    ]
    for r in reqs:
        sched.add(r)
    assert [r.request_id for r in sched.waiting] == ["first", "second", "middle", "low"]
    order = [scheduled(step(sched))[0][0] for _ in reqs]
    assert order == ["first", "second", "middle", "low"]
    assert not sched.has_unfinished()


@pytest.mark.parametrize("lazy_priority", [0, 5])
def test_preemption_takes_the_last_ranked_even_when_it_has_work_in_the_step(lazy_priority: int) -> None:
    # 4 blocks: "lazy" (6 tokens) and "urgent" (8 tokens) hold two each. In the next step lazy still fits
    # its second block and is scheduled first; urgent needs a third. At equal priority urgent is the newer
    # and preempts itself (FCFS); when lazy ranks last, its scheduled token is taken back instead.
    sched = make_scheduler(num_blocks=4)
    lazy = make_request("lazy", 6, priority=lazy_priority)
    urgent = make_request("urgent", 8)
    sched.add(lazy)
    assert scheduled(step(sched)) == [("lazy", 6)]
    sched.add(urgent)
    assert scheduled(step(sched)) == [("lazy", 1), ("urgent", 8)]
    batch = step(sched)
    assert batch.num_preempted == 1
    if lazy_priority == 0:
        assert scheduled(batch) == [("lazy", 1)]
        assert sched.running == [lazy] and list(sched.waiting) == [urgent]
    else:
        assert scheduled(batch) == [("urgent", 1)]
        assert sched.running == [urgent] and list(sched.waiting) == [lazy]
        assert lazy.num_computed_tokens == 0 and lazy.block_ids == [] and lazy.num_tokens == 8
        assert len(urgent.block_ids) == 3


def test_prefix_hit_on_admission_skips_computed_tokens() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    prefix = list(range(500, 512))
    a = make_request("a", [*prefix, 1, 2], max_tokens=1)
    sched.add(a)
    step(sched)
    assert a.finished
    b = make_request("b", [*prefix, 3], max_tokens=1)
    sched.add(b)
    assert scheduled(step(sched)) == [("b", 1)]
    assert b.num_cached_tokens == 12
    assert sched.block_manager.prefix_hits == 12


def test_cached_token_count_is_that_of_the_first_admission() -> None:
    """Request.num_cached_tokens is documented as the prompt tokens served from the prefix cache at
    first admission: a preempted request that is re-admitted (finding its own earlier blocks in the
    cache) must keep reporting its first admission's count, and never more than its prompt."""
    sched = make_scheduler(num_blocks=4)
    old, new = make_request("old", 5, max_tokens=5), make_request("new", 2, max_tokens=10)
    sched.add(old)
    sched.add(new)
    step(sched)
    assert old.num_cached_tokens == new.num_cached_tokens == 0
    while sched.num_preemptions == 0:
        step(sched)
    assert new.status is Status.WAITING
    assert new.num_tokens > BS  # its first block (prompt + output) is complete and cached
    while sched.has_unfinished():
        step(sched)
    assert new.num_output_tokens == 10
    assert new.num_cached_tokens <= new.num_prompt_tokens
    assert new.num_cached_tokens == 0


def test_random_workload_keeps_block_accounting_exact() -> None:
    rng = random.Random(0)
    sched = make_scheduler(
        num_blocks=24,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        chunk=6,
    )
    shared = [rng.randrange(50) for _ in range(12)]
    reqs = []
    for i in range(30):
        body = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
        prompt = [*shared, *body] if i % 3 == 0 else body
        reqs.append(make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 20)))
    pending = list(reqs)
    steps = 0
    while pending or sched.has_unfinished():
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        step(sched, next_token=rng.randrange(50))
        steps += 1
        assert steps < 2000
    assert all(r.finished and r.num_output_tokens == r.max_tokens for r in reqs)
    assert sched.num_preemptions > 0
    assert sched.block_manager.prefix_hits > 0
    bm = sched.block_manager
    assert bm.num_free == bm.num_blocks and not any(bm.ref_counts)


def test_drafts_take_no_block_a_later_running_request_needs() -> None:
    """Speculative decoding: a request's drafts take a free block only where the running requests after
    it in the step could still each take one, so drafting never makes the step preempt one of them."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    sched = Scheduler(config, BlockManager(4, BS, enable_prefix_caching=False), 64, drafter=Drafter(spec))
    a, b = make_request("a", [1, 2, 3, 1, 2, 3, 1]), make_request("b", 4)
    for req in (a, b):
        sched.add(req)
    batch = sched.schedule()  # both prompts: a takes two blocks, b one
    for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
        req.num_computed_tokens += n
        req.token_ids.append(2)
    assert sched.block_manager.num_free == 1
    # a's drafts ([3, 1, 2], after its last "1 2") would need the free block, which b's next token needs.
    batch = sched.schedule()
    assert batch.drafts == {} and batch.num_new_tokens == [1, 1] and batch.num_preempted == 0
    for req in (a, b):
        req.num_computed_tokens += 1
        req.token_ids.append(3)
    sched.finish(b)  # b's blocks are free: a drafts
    batch = sched.schedule()
    assert batch.drafts == {a: [1, 2, 3]} and batch.num_new_tokens == [4]


def test_a_request_whose_adapter_has_no_slot_is_deferred_and_counted() -> None:
    """With one LoRA slot, a request for a second adapter keeps its place while one behind it (no adapter)
    is admitted: the step counts it deferred (vLLM's num_requests_waiting_by_reason), until a slot frees."""
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64)
    sched = Scheduler(config, BlockManager(64, BS), 64, max_loras=1)
    first, second, plain = make_request("a", 4, max_tokens=1), make_request("b", 4), make_request("c", 4)
    first.lora, second.lora = LoRARequest("x", 1, "/x"), LoRARequest("y", 2, "/y")
    for r in (first, second, plain):
        sched.add(r)
    assert scheduled(step(sched)) == [("a", 4), ("c", 4)]
    assert sched.num_deferred == 1 and list(sched.waiting) == [second]
    assert ("b", 4) in scheduled(step(sched))  # "a" finished with its one token: its slot is free
    assert sched.num_deferred == 0
