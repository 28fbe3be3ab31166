"""BlockManager unit tests: reference counts, chained prefix hashes, LRU eviction, counters."""

from __future__ import annotations

import pytest

from kiln.engine.block_manager import BlockManager
from kiln.engine.request import Request
from kiln.sampling_params import SamplingParams

BS = 4  # block size used throughout


def make_request(token_ids: list[int], rid: str = "r", cache_salt: str = "", **params: object) -> Request:
    # The block manager never touches the detokenizer, so none is needed here.
    return Request(
        request_id=rid,
        parent_id=rid,
        params=SamplingParams(**params),
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids),
        max_tokens=16,
        text=None,  # type: ignore[arg-type]
        cache_salt=cache_salt,
    )


def compute(bm: BlockManager, req: Request, num_tokens: int | None = None) -> None:
    """What a step does for req: hold blocks for its tokens, 'compute' them, register full blocks."""
    num_tokens = req.num_tokens if num_tokens is None else num_tokens
    assert bm.allocate(req, num_tokens)
    req.num_computed_tokens = num_tokens
    bm.cache_full_blocks(req)


def admit(bm: BlockManager, req: Request) -> int:
    """Prefix lookup, then blocks for the whole request (as the scheduler admits a new request)."""
    hit = bm.match_prefix(req)
    req.num_computed_tokens = hit
    compute(bm, req)
    return hit


def refs(bm: BlockManager, req: Request) -> list[int]:
    return [bm.ref_counts[b] for b in req.block_ids]


def test_allocate_rounds_up_to_blocks_and_is_incremental() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request(list(range(100, 109)))  # 9 tokens
    assert bm.allocate(req, 1)
    assert req.block_ids == [0]
    assert bm.allocate(req, 4)  # still fits in the first block
    assert req.block_ids == [0]
    assert bm.allocate(req, 9)
    assert req.block_ids == [0, 1, 2]
    assert refs(bm, req) == [1, 1, 1]
    assert bm.num_free == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.free_request(req)
    assert req.block_ids == []
    assert bm.num_free == 8
    assert not any(bm.ref_counts)


def test_shared_prefix_blocks_are_reference_counted() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    prefix = list(range(100, 108))  # two full blocks
    a = make_request([*prefix, 1, 2, 3], "a")
    b = make_request([*prefix, 7, 8], "b")
    assert admit(bm, a) == 0
    assert admit(bm, b) == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert refs(bm, a) == [2, 2, 1]
    assert refs(bm, b) == [2, 2, 1]
    assert bm.num_free == 10 - 4

    bm.free_request(a)
    assert refs(bm, b) == [1, 1, 1]
    # a's private tail block is free again; the shared ones are still held by b.
    assert bm.num_free == 10 - 3
    assert not set(b.block_ids) & set(bm.free)

    c = make_request([*prefix, 9], "c")
    assert admit(bm, c) == 8
    assert refs(bm, c) == [2, 2, 1]

    bm.free_request(b)
    bm.free_request(c)
    assert bm.num_free == 10
    assert not any(bm.ref_counts)


def test_hashes_are_chained_over_the_prefix() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a = make_request([*x, *y, *z, 0], "a")
    admit(bm, a)
    assert len(bm.cached) == 3

    # Same content as a's second and third blocks, but behind a different first block: no match.
    b = make_request([*z, *y, *z, 0], "b")
    assert b.block_ids == []
    assert admit(bm, b) == 0
    bm.update_hashes(b)
    assert b.block_hashes[1] != a.block_hashes[1]
    assert b.block_hashes[2] != a.block_hashes[2]

    # First block matches, second differs, third equals a's third: the match stops at the first miss.
    c = make_request([*x, *z, *z, 0], "c")
    assert admit(bm, c) == 4
    assert c.block_ids[0] == a.block_ids[0]
    assert c.block_ids[2] != a.block_ids[2]

    # Identical content and prefix hash identically.
    d = make_request([*x, *y, *z, 0], "d")
    assert admit(bm, d) == 12
    assert d.block_hashes == a.block_hashes
    assert d.block_ids[:3] == a.block_ids[:3]


def test_a_cache_salt_shares_blocks_only_with_the_same_salt() -> None:
    bm = BlockManager(num_blocks=32, block_size=BS)
    prompt = [*range(300, 312), 0]
    alice = make_request(prompt, "alice", cache_salt="alice-secret")
    assert admit(bm, alice) == 0
    assert admit(bm, make_request(prompt, "alice-again", cache_salt="alice-secret")) == 12
    assert admit(bm, make_request(prompt, "bob", cache_salt="bob-secret")) == 0
    plain = make_request(prompt, "plain")
    assert admit(bm, plain) == 0
    # Every block differs, not only the first: the salt is in each block's chained hash.
    assert not set(plain.block_hashes) & set(alice.block_hashes)
    assert admit(bm, make_request(prompt, "plain-again")) == 12


def test_match_never_covers_the_last_prompt_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(200, 212))  # exactly three full blocks
    a = make_request([*prompt, 1], "a")
    admit(bm, a)
    assert len(bm.cached) == 3

    same = make_request(prompt, "same")  # fully cached, but its last token's logits are needed
    assert bm.match_prefix(same) == 8
    assert len(same.block_ids) == 2
    bm.free_request(same)

    one_more = make_request([*prompt, 5], "one-more")
    assert bm.match_prefix(one_more) == 12
    bm.free_request(one_more)

    tiny = make_request(prompt[:4], "tiny")  # a single full block that is its whole prompt
    assert bm.match_prefix(tiny) == 0
    assert tiny.block_ids == []


def test_match_is_off_without_prefix_caching_or_with_prompt_logprobs() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(300, 309))
    admit(bm, make_request(prompt, "a"))
    assert bm.match_prefix(make_request(prompt, "b", prompt_logprobs=1)) == 0

    off = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    admit(off, make_request(prompt, "a"))
    assert off.cached == {}
    assert off.match_prefix(make_request(prompt, "b")) == 0
    assert off.prefix_queries == 0 and off.prefix_hits == 0


def test_only_computed_full_blocks_are_registered() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    req = make_request(list(range(50, 61)), "a")  # 11 tokens
    compute(bm, req, 6)  # chunk one: one full block computed
    assert len(bm.cached) == 1
    assert req.num_registered_blocks == 1
    compute(bm, req, 11)
    assert len(bm.cached) == 2
    assert [bm.hashes[b] for b in req.block_ids] == [*req.block_hashes, None]
    # Generated tokens fill the third block; once computed it is registered too.
    req.token_ids.append(61)
    compute(bm, req, 12)
    assert len(bm.cached) == 3
    assert bm.cached[req.block_hashes[2]] == req.block_ids[2]


def test_freed_blocks_stay_reusable_until_reallocated() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    prompt = list(range(10, 19))  # 9 tokens: two full blocks and one partial
    a = make_request(prompt, "a")
    admit(bm, a)
    a_blocks = list(a.block_ids)
    bm.free_request(a)
    assert bm.num_free == 6

    again = make_request(prompt, "again")
    assert bm.match_prefix(again) == 8
    assert again.block_ids == a_blocks[:2]
    assert refs(bm, again) == [1, 1]
    assert bm.num_free == 4
    assert not set(again.block_ids) & set(bm.free)
    bm.free_request(again)

    # Handing every block out again evicts the cached content.
    hog = make_request(list(range(1000, 1024)), "hog")
    assert bm.allocate(hog, 24)
    assert bm.cached == {}
    assert all(bm.hashes[b] is None for b in hog.block_ids)
    bm.free_request(hog)
    assert bm.match_prefix(make_request(prompt, "late")) == 0


def test_lru_evicts_least_recently_freed_first_and_tails_before_heads() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request([*range(10, 22), 0], "a")  # three full blocks + a partial one
    b = make_request([*range(40, 52), 0], "b")
    admit(bm, a)
    admit(bm, b)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    bm.free_request(a)  # freed first: least recently used
    bm.free_request(b)

    # Least recently freed first; within a request its tail (last block) goes before its head.
    assert list(bm.free) == [*reversed(a_blocks), *reversed(b_blocks)]

    def cached_tokens(req: Request) -> int:
        """Tokens of req's leading blocks still in the prefix cache (looked up without touching LRU order)."""
        n = 0
        while n < len(req.block_hashes) and req.block_hashes[n] in bm.cached:
            n += 1
        return n * BS

    new = make_request(list(range(500, 508)), "new")
    assert bm.allocate(new, 8)  # two blocks: a's partial tail and a's third block
    assert new.block_ids == [a_blocks[3], a_blocks[2]]
    assert cached_tokens(a) == 8  # a's head (first two blocks) survives
    assert cached_tokens(b) == 12

    assert bm.allocate(new, 16)  # two more: the rest of a
    assert new.block_ids[2:] == [a_blocks[1], a_blocks[0]]
    assert cached_tokens(a) == 0
    assert cached_tokens(b) == 12

    assert bm.allocate(new, 24)  # now b's tail: its partial block, then its third block
    assert new.block_ids[4:] == [b_blocks[3], b_blocks[2]]
    assert cached_tokens(b) == 8
    assert bm.num_free == 2


def test_reused_blocks_are_refreshed_in_lru_order() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_request([*range(10, 14), 0], "a")
    b = make_request([*range(20, 24), 0], "b")
    admit(bm, a)
    admit(bm, b)
    bm.free_request(a)
    bm.free_request(b)
    # Touching a's cached block again makes it the most recently used once freed.
    a2 = make_request(a.token_ids, "a2")
    assert admit(bm, a2) == 4
    bm.free_request(a2)
    hog = make_request(list(range(900, 920)), "hog")
    assert bm.allocate(hog, 20)  # five of six blocks: only the most recently freed survives
    assert len(bm.cached) == 1
    assert bm.match_prefix(make_request(a.token_ids, "a3")) == 4


def test_allocate_fails_without_changing_anything() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    holder = make_request(list(range(12)), "holder")
    compute(bm, holder)  # 3 blocks, all registered
    req = make_request(list(range(100, 110)), "req")
    assert bm.allocate(req, 3)
    free_before, cached_before = (bm.next_unused, list(bm.free)), dict(bm.cached)
    hashes_before, refs_before = list(bm.hashes), list(bm.ref_counts)

    assert not bm.allocate(req, 10)  # needs two more blocks, none free
    assert req.block_ids != [] and len(req.block_ids) == 1
    assert (bm.next_unused, list(bm.free)) == free_before
    assert bm.cached == cached_before
    assert bm.hashes == hashes_before
    assert bm.ref_counts == refs_before

    fresh = make_request(list(range(200, 220)), "fresh")
    assert not bm.allocate(fresh, 5)
    assert fresh.block_ids == []
    assert bm.allocate(fresh, 0)  # nothing needed always succeeds
    assert fresh.block_ids == []


def test_hit_and_query_counters() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(60, 70))  # 10 tokens, two full blocks
    admit(bm, make_request(prompt, "a"))
    assert (bm.prefix_queries, bm.prefix_hits) == (10, 0)
    admit(bm, make_request([*prompt, 1, 2], "b"))
    assert (bm.prefix_queries, bm.prefix_hits) == (22, 8)
    admit(bm, make_request([*prompt[:4], 9, 9, 9, 9, 9], "c"))
    assert (bm.prefix_queries, bm.prefix_hits) == (31, 12)
    # Disabled lookups (prompt logprobs) are not counted.
    bm.match_prefix(make_request(prompt, "d", prompt_logprobs=0))
    assert (bm.prefix_queries, bm.prefix_hits) == (31, 12)
