"""Prometheus metrics with vLLM's names under a `kiln:` prefix, in a registry of their own."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.engine.grammar import COMPILE_BUCKETS
from kiln.engine.queue_limits import REASONS
from kiln.engine.request_output import RequestOutput
from kiln.engine.request_stream import RequestStream
from kiln.engine.speculative import DraftStats
from kiln.sampling_params import SamplingParams

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920)
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_BUCKETS = (1, *(2**i for i in range(3, 15)))  # vLLM's tokens per engine step: 1, 8, ... 16384


def tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out: list[float] = []
    for scale in itertools.count():
        for step in (1, 2, 5):
            if step * 10**scale > max_model_len:
                return tuple(out)
            out.append(step * 10**scale)
    raise AssertionError  # itertools.count never ends


class _EngineState(Collector):
    """Read from the engine at scrape time, so gauges are never stale."""

    def __init__(self, model_name: str, stats: Callable[[], dict[str, Any]]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        for family, name, doc, key in (
            (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", "running"),
            (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", "waiting"),
            (
                GaugeMetricFamily,
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use.",
                "kv_cache_usage",
            ),
            (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up.", "prefix_cache_queries"),
            (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found cached.", "prefix_cache_hits"),
            (CounterMetricFamily, "num_preemptions", "Requests preempted.", "preemptions"),
        ):
            metric = family(f"kiln:{name}", doc, labels=["model_name"])
            metric.add_metric([self.model_name], s[key])
            yield metric
        by_reason = GaugeMetricFamily(
            "kiln:num_requests_waiting_by_reason",
            "Requests waiting to be scheduled, by reason: capacity (no room in the batch or the KV cache), "
            "deferred (a grammar compiling, an adapter past the LoRA slots).",
            labels=["model_name", "reason"],
        )
        deferred = min(s["deferred"], s["waiting"])  # (the count of the last step; some may have left since)
        by_reason.add_metric([self.model_name, "capacity"], s["waiting"] - deferred)
        by_reason.add_metric([self.model_name, "deferred"], deferred)
        yield by_reason
        g = s["grammars"]
        for name, doc, value in (
            ("grammar_cache_hits", "Constrained requests whose grammar was compiled already.", g.hits),
            ("grammar_cache_misses", "Constrained requests whose grammar had to be compiled.", g.misses),
        ):
            counter = CounterMetricFamily(f"kiln:{name}", doc, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter
        if s["lora"] is not None:
            lora = s["lora"]
            labels = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
            info = GaugeMetricFamily(
                "kiln:lora_requests_info", "Running stats on LoRA requests.", labels=labels
            )
            info.add_metric([str(lora["max_lora"]), lora["waiting"], lora["running"]], time.time())
            yield info
        if s["drafts"] is not None:
            yield from _draft_counters(self.model_name, s["drafts"])
        labels = {"engine": "0", **s["cache_config"]}
        info = GaugeMetricFamily(
            "kiln:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(labels)
        )
        info.add_metric(list(labels.values()), 1)
        yield info
        histogram = HistogramMetricFamily(
            "kiln:grammar_compile_seconds", "Time to compile a grammar.", labels=["model_name"]
        )
        cumulative = list(itertools.accumulate(g.compile_buckets))
        bounds = [str(b) for b in COMPILE_BUCKETS] + ["+Inf"]
        histogram.add_metric([self.model_name], list(zip(bounds, cumulative, strict=True)), g.compile_seconds)
        yield histogram


def _draft_counters(model_name: str, drafts: DraftStats) -> Iterator[Metric]:
    """vLLM's spec_decode counters."""
    for name, doc, value in (
        ("num_drafts", "Number of spec decoding drafts.", drafts.num_drafts),
        ("num_draft_tokens", "Number of draft tokens.", drafts.num_draft_tokens),
        ("num_accepted_tokens", "Number of accepted tokens.", drafts.num_accepted_tokens),
    ):
        counter = CounterMetricFamily(f"kiln:spec_decode_{name}", doc, labels=["model_name"])
        counter.add_metric([model_name], value)
        yield counter
    per_pos = CounterMetricFamily(
        "kiln:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=["model_name", "position"],
    )
    for pos, value in enumerate(drafts.accepted_per_pos):
        per_pos.add_metric([model_name, str(pos)], value)
    yield per_pos


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], dict[str, Any]], max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(model_name, stats))
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"kiln:{name}", doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"kiln:{name}", doc, labels, buckets=buckets, registry=self.registry)

        def per_request(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return histogram(f"request_{name}", doc, buckets).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(model_name)
        self.cached_tokens = counter("prompt_tokens_cached", "Prompt tokens found cached.").labels(model_name)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Prompt and generated tokens per engine step.", ITERATION_BUCKETS
        ).labels(model_name)
        self._success = counter("request_success", "Finished requests by reason.", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS).labels(
            model_name
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        ).labels(model_name)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS).labels(
            model_name
        )
        # Each finished request's phases and sizes, as vLLM's dashboards read them.
        tokens, seconds = tokens_buckets(max_model_len), E2E_BUCKETS
        self.queue_time = per_request("queue_time_seconds", "Arrival to first scheduled.", seconds)
        self.prefill_time = per_request("prefill_time_seconds", "First scheduled to first token.", seconds)
        self.decode_time = per_request("decode_time_seconds", "First token to finish.", seconds)
        self.inference_time = per_request("inference_time_seconds", "First scheduled to finish.", seconds)
        self.prompt_len = per_request("prompt_tokens", "Prompt tokens of a request.", tokens)
        self.output_len = per_request("generation_tokens", "Tokens a request generated.", tokens)
        self.longest = per_request(
            "max_num_generation_tokens", "A request's longest sequence, in tokens.", tokens
        )
        self.n = per_request("params_n", "A request's n.", N_BUCKETS)
        self.max_tokens = per_request("params_max_tokens", "A request's max_tokens.", tokens)
        self.computed = per_request(
            "prefill_kv_computed_tokens", "Prompt tokens computed, not cached.", tokens
        )
        self.tpot = per_request(
            "time_per_output_token_seconds", "A request's mean gap between tokens.", ITL_BUCKETS
        )
        # vLLM's: requests refused by the scheduler's queue limits (a 503), by the limit; both start at 0.
        self._rejected = counter("admission_rejections", "Requests over a queue limit.", ("reason",))
        for reason in REASONS:
            self._rejected.labels(model_name, reason)
        self.model_name = model_name

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def observe(self, stream: RequestStream, out: RequestOutput, now: float) -> int:
        """One output of a request, on the event loop (now: time.monotonic, the engine's clock too): its
        tokens and their gaps, its finished sequences, and once it is done its phases and sizes. Returns
        the tokens it counted (its prompt's, at its first output, and the new ones), for the step's."""
        new_tokens = sum(len(o.token_ids) for o in out.outputs)
        counted = new_tokens
        stream.scheduled_at = stream.scheduled_at or out.scheduled_at
        if out.embedding is not None or (new_tokens and stream.num_tokens == 0):
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.cached_tokens.inc(out.num_cached_tokens)
            counted += len(out.prompt_token_ids)
        if new_tokens:
            if stream.num_tokens == 0:
                self.ttft.observe(now - stream.arrival)
                stream.first_token_at = now
            else:
                self.itl.observe(now - stream.last_token_at)
            self.generation_tokens.inc(new_tokens)
            stream.num_tokens += new_tokens
            stream.last_token_at = now
        for o in out.outputs:
            stream.seq_tokens[o.index] = stream.seq_tokens.get(o.index, 0) + len(o.token_ids)
            if o.finished:
                self.finished(o.finish_reason or "abort")
        if out.finished:
            self.e2e.observe(now - stream.arrival)
            self._request(stream, out, now)
        return counted

    def step(self, tokens: int) -> None:
        """An engine step's outputs, counted by observe."""
        if tokens:
            self.iteration_tokens.observe(tokens)

    def _request(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        """A finished request's phases and sizes."""
        if out.scheduled_at:  # (an abort may come before it was ever scheduled)
            self.queue_time.observe(out.scheduled_at - stream.arrival)
            self.inference_time.observe(now - out.scheduled_at)
            if stream.first_token_at:
                self.prefill_time.observe(stream.first_token_at - out.scheduled_at)
                self.decode_time.observe(now - stream.first_token_at)
                if stream.num_tokens > 1:
                    self.tpot.observe((now - stream.first_token_at) / (stream.num_tokens - 1))
        self.prompt_len.observe(len(out.prompt_token_ids))
        self.computed.observe(len(out.prompt_token_ids) - out.num_cached_tokens)
        self.output_len.observe(stream.num_tokens)
        self.longest.observe(max(stream.seq_tokens.values(), default=0))
        p = stream.params
        if isinstance(p, SamplingParams):
            self.n.observe(p.n)
            if p.max_tokens is not None:
                self.max_tokens.observe(p.max_tokens)

    def token_totals(self) -> tuple[float, float]:
        """Prompt and generated tokens so far."""
        labels = {"model_name": self.model_name}
        read = self.registry.get_sample_value
        prompt = read("kiln:prompt_tokens_total", labels) or 0.0
        return prompt, read("kiln:generation_tokens_total", labels) or 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
