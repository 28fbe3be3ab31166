"""Hands out KV-cache blocks, counts references, and caches full blocks by a chained hash of their tokens
(and of their prompt embeddings, where a prompt was given as embeddings)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from kiln.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        """Makes no object per block (two lists and a counter): a tiny model on a large GPU has millions."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        # Blocks from next_unused on were never handed out; they go first, in id order. Then the freed
        # blocks, least recently used first: a freed block may still hold a cached prefix, which stays
        # reusable until the block is handed out again (LRU eviction).
        self.next_unused = 0
        self.free: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.next_unused + len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def update_hashes(self, req: Request) -> None:
        """Extends req.block_hashes over every full block of its tokens: SHA-256 of (parent hash, tokens),
        the first block's parent being the request's hash_root (its cache_salt and adapter). SHA-256
        (vLLM's default), not Python's hash: a tuple of ints hashes without a secret key by invertible
        steps, so a client could craft blocks that hash as a common prompt's (a known system prompt) and
        poison what later requests with it are served."""
        bs = self.block_size
        start, end = len(req.block_hashes), req.num_tokens // bs
        if start == end:
            return
        tokens = array("q", req.token_ids[start * bs : end * bs]).tobytes()
        width = bs * 8  # bytes of a block's ids
        parent = req.block_hashes[-1] if req.block_hashes else req.hash_root
        embeds, prompt = req.prompt_embeds, req.num_prompt_tokens
        for i in range(end - start):
            block = tokens[i * width : (i + 1) * width]
            first = (start + i) * bs
            if embeds is not None and first < prompt:  # its ids are placeholders: the rows are its content
                block += embeds[first : min(first + bs, prompt)].view(torch.uint8).numpy().tobytes()
            parent = hashlib.sha256(parent + block).digest()
            req.block_hashes.append(parent)

    def match_prefix(self, req: Request) -> int:
        """Takes the longest cached prefix of a new request; returns the number of tokens it covers.
        The last prompt token is always recomputed, since its logits are needed."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return 0
        self.update_hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in req.block_hashes[:limit]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        for block_id in hit:
            self._take(block_id)
        req.block_ids = hit
        req.num_registered_blocks = len(hit)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hit) * self.block_size
        return len(hit) * self.block_size

    def allocate(self, req: Request, num_tokens: int, keep_free: int = 0) -> bool:
        """Makes req hold blocks for its first num_tokens tokens; False (and no change) if it can't while
        leaving keep_free blocks free."""
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        if need <= 0:  # most steps: a decode token that fits in its last block
            return True
        if need > self.num_free - keep_free:
            return False
        fresh = min(need, self.num_blocks - self.next_unused)
        for block_id in range(self.next_unused, self.next_unused + fresh):
            self.ref_counts[block_id] = 1
            req.block_ids.append(block_id)
        self.next_unused += fresh
        for _ in range(need - fresh):
            block_id, _ = self.free.popitem(last=False)
            h = self.hashes[block_id]
            if h is not None:
                if self.cached.get(h) == block_id:
                    del self.cached[h]
                self.hashes[block_id] = None
            self.ref_counts[block_id] = 1
            req.block_ids.append(block_id)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Registers the blocks whose KV is now complete, so later requests can share them."""
        full = min(req.num_computed_tokens, req.num_tokens) // self.block_size  # (pending ids aren't known)
        if not self.enable_prefix_caching or full <= req.num_registered_blocks:  # most steps fill no block
            return
        self.update_hashes(req)
        for i in range(req.num_registered_blocks, full):
            block_id = req.block_ids[i]
            if self.hashes[block_id] is None:
                self.hashes[block_id] = req.block_hashes[i]
                self.cached.setdefault(req.block_hashes[i], block_id)
        req.num_registered_blocks = max(full, req.num_registered_blocks)

    def free_request(self, req: Request) -> None:
        # Tail blocks go to the LRU end first, so a request's prefix outlives its suffix.
        for block_id in reversed(req.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None
        req.block_ids = []
        req.num_registered_blocks = 0

    def _take(self, block_id: int) -> None:
        """A cached block (so one handed out before): free, it leaves the free list."""
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's reset_prefix_cache); False, and nothing forgotten, while a
        request holds blocks."""
        if any(self.ref_counts):
            return False
        self.cached.clear()
        self.hashes = [None] * self.num_blocks
        return True
