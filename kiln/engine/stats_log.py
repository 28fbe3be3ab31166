"""vLLM's periodic engine line: throughput since the last line, the queue, the KV cache, and the prefix
cache's hit rate over that span (off with --disable-log-stats)."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.engine.metrics import Metrics
from kiln.engine.speculative import DraftStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StatsLog:
    """At INFO while the engine works, or did in the span before, else at DEBUG: an idle server's log
    stays quiet, as vLLM's."""

    metrics: Metrics
    at: float  # time.monotonic() of the last line
    prompt: float = 0.0  # the counters at the last line
    generation: float = 0.0
    queries: int = 0
    hits: int = 0
    busy: bool = False  # the last span had work
    drafts: DraftStats | None = None  # the spec_decode counters at the last line

    def line(self, now: float, stats: dict[str, Any]) -> tuple[str, bool]:
        """The line for the span since the last, and whether it goes out at INFO."""
        prompt, generation = self.metrics.token_totals()
        span = max(now - self.at, 1e-9)
        prompt_rate, generation_rate = (prompt - self.prompt) / span, (generation - self.generation) / span
        queries = stats["prefix_cache_queries"] - self.queries
        hits = stats["prefix_cache_hits"] - self.hits
        text = (
            f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
            f"Avg generation throughput: {generation_rate:.1f} tokens/s, "
            f"Running: {stats['running']} reqs, Waiting: {stats['waiting']} reqs, "
            f"KV cache usage: {100 * stats['kv_cache_usage']:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
        busy = bool(prompt_rate or generation_rate or stats["running"] or stats["waiting"])
        loud, self.busy = busy or self.busy, busy
        self.at, self.prompt, self.generation = now, prompt, generation
        self.queries, self.hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
        return text, loud

    def draft_line(self, span: float, stats: dict[str, Any]) -> str | None:
        """vLLM's SpecDecoding line over the span, where the engine speculates and drafted in it."""
        now: DraftStats | None = stats["drafts"]
        if now is None:
            return None
        last = self.drafts or DraftStats(accepted_per_pos=[0] * len(now.accepted_per_pos))
        self.drafts = copy.deepcopy(now)
        drafts = now.num_drafts - last.num_drafts
        if not drafts:
            return None
        accepted = now.num_accepted_tokens - last.num_accepted_tokens
        drafted = now.num_draft_tokens - last.num_draft_tokens
        per_pos = zip(now.accepted_per_pos, last.accepted_per_pos, strict=True)
        rates = ", ".join(f"{(a - b) / drafts:.3f}" for a, b in per_pos)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {accepted / span:.2f} tokens/s, "
            f"Drafted throughput: {drafted / span:.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {100 * accepted / drafted:.1f}%"
        )


async def log_stats(metrics: Metrics, stats: Callable[[], dict[str, Any]], interval: float) -> None:
    """The line every `interval` seconds, until cancelled."""
    lines = StatsLog(metrics, time.monotonic())
    while True:
        await asyncio.sleep(interval)
        now, state = time.monotonic(), stats()
        span = max(now - lines.at, 1e-9)
        text, loud = lines.line(now, state)
        log.log(logging.INFO if loud else logging.DEBUG, "%s", text)
        drafts = lines.draft_line(span, state)
        if drafts is not None:
            log.info("%s", drafts)
