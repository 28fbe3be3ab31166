"""vLLM's periodic engine line (kiln.engine.stats_log): rates over the span since the last line, and INFO
only while there is work or was in the span before."""

from __future__ import annotations

from kiln.engine.grammar import GrammarStats
from kiln.engine.metrics import Metrics
from kiln.engine.speculative import DraftStats
from kiln.engine.stats_log import StatsLog


def state(running: int = 0, waiting: int = 0, queries: int = 0, hits: int = 0) -> dict[str, object]:
    return {
        "running": running, "waiting": waiting, "kv_cache_usage": 0.25,
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
    }  # fmt: skip


def test_rates_over_the_span_and_quiet_when_idle() -> None:
    metrics = Metrics(
        "m",
        lambda: {
            **state(),
            "preemptions": 0,
            "deferred": 0,
            "grammars": GrammarStats(),
            "lora": None,
            "drafts": None,
            "cache_config": {"block_size": "16"},
        },
        512,
    )
    log = StatsLog(metrics, at=100.0)
    assert log.line(110.0, state()) == (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, "
        "Waiting: 0 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 0.0%",
        False,  # idle: DEBUG
    )
    metrics.prompt_tokens.inc(200)
    metrics.generation_tokens.inc(50)
    text, loud = log.line(120.0, state(running=2, waiting=1, queries=400, hits=100))
    assert loud and text == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    text, loud = log.line(125.0, state(queries=400, hits=100))  # idle, after work: one more at INFO
    assert loud and text.startswith("Avg prompt throughput: 0.0 tokens/s") and text.endswith("rate: 0.0%")
    assert not log.line(135.0, state(queries=400, hits=100))[1]


def test_the_spec_decoding_line_over_the_span() -> None:
    """vLLM's SpecDecoding line: what the span's drafts kept, overall and at each position."""
    log = StatsLog(Metrics("m", lambda: {}, 512), at=100.0)
    drafts = DraftStats(accepted_per_pos=[0, 0, 0])
    assert log.draft_line(10.0, {"drafts": None}) is None  # no --speculative-config
    assert log.draft_line(10.0, {"drafts": drafts}) is None  # nothing drafted in the span
    drafts.record(4, 3)  # three drafts, two kept
    drafts.record(4, 1)  # three drafts, none kept
    drafts.record(1, 1)  # a request without drafts in the step
    assert log.draft_line(2.0, {"drafts": drafts}) == (
        "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted throughput: 1.00 tokens/s, "
        "Drafted throughput: 3.00 tokens/s, Accepted: 2 tokens, Drafted: 6 tokens, "
        "Per-position acceptance rate: 0.500, 0.500, 0.000, Avg Draft acceptance rate: 33.3%"
    )
    assert log.draft_line(2.0, {"drafts": drafts}) is None
