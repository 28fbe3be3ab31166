"""Chooses each step's work: running requests first, then waiting ones, within a token budget. Long prompts
(more than `chunk` tokens left: vLLM's long_prefill_token_threshold) share `chunk` tokens apiece of a step,
handed out oldest first, so a short prompt that arrives while long ones are chunked starts beside them, and
long prompts that arrive together finish in turn. Requests rank by (priority, arrival): waiting ones
are admitted in that order, and the last-ranked running one is preempted first. Priorities stay 0 under
the fcfs policy, which leaves arrival order."""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kiln.config import SchedulerConfig
from kiln.engine.block_manager import BlockManager
from kiln.engine.request import Request, Status
from kiln.engine.speculative import Drafter

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # per request: tokens to compute this step (a prefill chunk, or 1 + drafts)
    num_preempted: int = 0
    drafts: dict[Request, list[int]] = field(default_factory=dict)  # those that speculate: their drafts

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        chunk: int,
        max_loras: int | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """max_loras: the most LoRA adapters the running requests may use at once (the model's slots);
        drafter: where a decoding request's drafts come from (speculative decoding)."""
        self.max_num_seqs = config.max_num_seqs
        self.drafter = drafter
        self.max_loras = max_loras
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunk = chunk
        self.chunked = config.enable_chunked_prefill
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()  # in rank order
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        # Waiting requests the last admission passed over (a grammar compiling, an adapter past the slots, a
        # token in flight) while it admitted those behind: vLLM's "deferred" waiting requests.
        self.num_deferred = 0
        self._arrivals = itertools.count()

    def add(self, req: Request) -> None:
        req.arrival = next(self._arrivals)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        """Into the waiting queue in rank order; at either end (most often) without a search."""
        waiting, rank = self.waiting, _rank(req)
        if not waiting or rank >= _rank(waiting[-1]):
            waiting.append(req)
        elif rank <= _rank(waiting[0]):
            waiting.appendleft(req)
        else:
            bisect.insort(waiting, req, key=_rank)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget, chunk = self.max_num_batched_tokens, self.chunk
        allowance = -1  # the long prefills' share: found where the first one needs it (a decode never does)
        batch = ScheduledBatch([], [])
        max_drafts = 0 if self.drafter is None else self.drafter.k_for(len(self.running))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.ends_by_length:
                i += 1
                continue
            left = req.num_tokens + req.num_pending - req.num_computed_tokens
            long = left > chunk
            if long:
                if allowance < 0:
                    allowance = self._long_allowance()
                num_new = min(left, budget, allowance)
                if not num_new:  # older long prefills took this step's share
                    i += 1
                    continue
            else:
                num_new = min(left, budget)
            drafts = None
            if max_drafts:
                drafts = self._drafts(req, min(max_drafts, budget - 1), len(self.running) - i - 1)
            while not self.block_manager.allocate(req, req.num_computed_tokens + num_new):
                victim = max(self.running, key=_rank)
                j = self.running.index(victim)
                del self.running[j]
                if j < i:
                    i -= 1
                    if victim in batch.requests:  # it has work in this step already: take it back
                        k = batch.requests.index(victim)
                        del batch.requests[k]
                        taken = batch.num_new_tokens.pop(k)
                        budget += taken
                        if victim.num_tokens + victim.num_pending - victim.num_computed_tokens > chunk:
                            allowance += taken  # a long prefill's: back to the share
                        batch.drafts.pop(victim, None)
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is req:
                    break
            else:
                if drafts:
                    batch.drafts[req] = drafts
                    num_new += len(drafts)
                batch.requests.append(req)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                if long:
                    allowance -= num_new
                i += 1
        # After a preemption there is no room to spare: admitting would only thrash. A request whose grammar
        # is still compiling, or whose adapter would be one more than the slots, keeps its place in the queue
        # while those behind it go ahead (vLLM's rule for adapters).
        skipped: list[Request] = []
        held = 0
        loras = {r.lora.lora_int_id for r in self.running if r.lora is not None} if self.max_loras else set()
        while (
            self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.num_preempted
        ):
            req = self.waiting[0]
            # (A request preempted with a token in flight waits for it: it is landed before the next step.)
            new_lora = req.lora is not None and req.lora.lora_int_id not in loras
            if (
                req.num_pending
                or (req.grammar is not None and not req.grammar.ready)
                or (new_lora and len(loras) >= (self.max_loras or 0))
            ):
                skipped.append(self.waiting.popleft())
                continue
            if req.num_tokens - req.num_computed_tokens > chunk:  # a long prompt
                if allowance < 0:
                    allowance = self._long_allowance()
                if not allowance:  # the step's share is spent: shorter prompts behind it may still start
                    if held >= self.max_num_seqs - len(self.running):  # (a step's room passed over at most)
                        break
                    held += 1
                    skipped.append(self.waiting.popleft())
                    continue
            if req.num_computed_tokens == 0 and (req.pooling is None or req.pooling.reads_cache):
                req.num_computed_tokens = self.block_manager.match_prefix(req)
            left = req.num_tokens - req.num_computed_tokens
            num_new = left if left <= chunk else min(left, allowance)
            # Unchunked, as vLLM: the prompt whole (or its threshold's part) or, this step, nothing more.
            if (num_new > budget and not self.chunked) or not self.block_manager.allocate(
                req, req.num_computed_tokens + min(num_new, budget)
            ):
                self.block_manager.free_request(req)
                req.num_computed_tokens = 0
                break
            num_new = min(num_new, budget)
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
                req.scheduled_at = time.monotonic()
            req.status = Status.RUNNING
            if req.lora is not None:
                loras.add(req.lora.lora_int_id)
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            if left > chunk:
                allowance -= num_new
        self.waiting.extendleft(reversed(skipped))  # they ranked first
        self.num_deferred = len(skipped) - held
        return batch

    def _long_allowance(self) -> int:
        """The tokens this step's long prefills (more than `chunk` left) share: `chunk` for each that could
        run, as vLLM's long_prefill_token_threshold gives them, but handed out oldest first. Steps are as
        full as before, and prompts that arrive together get their first tokens in turn, not all at the end
        (a burst of 32 long prompts: the median TTFT of its first half, not the whole burst)."""
        chunk, budget = self.chunk, self.max_num_batched_tokens
        if chunk >= budget:
            return budget
        n = sum(r.num_tokens + r.num_pending - r.num_computed_tokens > chunk for r in self.running)
        for req in itertools.islice(self.waiting, max(self.max_num_seqs - len(self.running), 0)):
            if n * chunk >= budget:
                break
            n += req.num_tokens - req.num_computed_tokens > chunk
        return min(n * chunk, budget)

    def _drafts(self, req: Request, room: int, after: int) -> list[int]:
        """At most `room` drafts for a decoding request, where the free blocks hold them and still a block
        for each of the `after` running requests that follow it in the step: drafting never preempts."""
        decoding = req.num_computed_tokens == req.num_tokens - 1 and not req.num_pending
        if self.drafter is None or not decoding or room < 1:
            return []
        drafts = self.drafter.propose(req, room)
        if drafts and not self.block_manager.allocate(req, req.num_tokens + len(drafts), keep_free=after):
            return []
        return drafts

    def preempt_running(self) -> None:
        """Every running request back to waiting, its KV dropped: they resume by recompute."""
        for req in self.running:
            self._preempt(req)
        self.running.clear()

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop its KV; it resumes from the prefix cache or from scratch."""
        self.block_manager.free_request(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        self._enqueue(req)
        self.num_preemptions += 1
        log.debug("preempted %s (%d tokens)", req.request_id, req.num_tokens)

    def finish(self, req: Request) -> None:
        """Frees a finished or aborted request's blocks at once."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.block_manager.free_request(req)
        req.status = Status.FINISHED


def _rank(req: Request) -> tuple[int, int]:
    return req.priority, req.arrival
