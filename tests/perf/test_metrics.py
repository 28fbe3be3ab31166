"""Metric definitions checked to the digit on synthetic timings, and the client's SSE parsing."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from kiln.perf.client import Endpoint, send
from kiln.perf.dataset import Prompt, make_prompts
from kiln.perf.metrics import RequestRecord, summarize
from kiln.perf.spec import SLO, Spec

# One token per chunk; several tokens per chunk; a failure mid-stream.
STEADY = RequestRecord(prompt_tokens=10, output_tokens=5, ttft=0.1, itl=[0.05] * 4, latency=0.3, success=True)
CHUNKY = RequestRecord(prompt_tokens=20, output_tokens=6, ttft=0.2, itl=[0.1, 0.1], latency=0.4, success=True)
BROKEN = RequestRecord(prompt_tokens=30, ttft=0.05, itl=[0.01], error="error event: engine died")


def test_summary_values() -> None:
    s = summarize([STEADY, CHUNKY, BROKEN], duration_s=2.0, slo=SLO(ttft_ms=150, tpot_ms=60))
    assert (s.completed, s.failed, s.errors) == (2, 1, ["error event: engine died"])
    assert (s.total_input_tokens, s.total_output_tokens) == (30, 11)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(5.5)
    assert s.total_token_throughput == pytest.approx(20.5)
    assert s.goodput == pytest.approx(0.5)  # CHUNKY's TTFT of 200 ms misses the 150 ms SLO
    assert (s.ttft_ms.mean, s.ttft_ms.median, s.ttft_ms.p90, s.ttft_ms.p99) == pytest.approx(
        (150, 150, 190, 199)
    )
    # TPOT: (0.3 - 0.1) / 4 = 50 ms and (0.4 - 0.2) / 5 = 40 ms
    assert (s.tpot_ms.mean, s.tpot_ms.median, s.tpot_ms.p90, s.tpot_ms.p99) == pytest.approx(
        (45, 45, 49, 49.9)
    )
    # ITL: one entry per chunk, so CHUNKY's 2-token chunks give 100 ms gaps: [50]*4 + [100]*2
    assert (s.itl_ms.mean, s.itl_ms.median, s.itl_ms.p90, s.itl_ms.p99) == pytest.approx(
        (200 / 3, 50, 100, 100)
    )
    assert (s.e2el_ms.mean, s.e2el_ms.p99) == pytest.approx((350, 399))
    assert s.tokens_per_user == pytest.approx(1000 / 45)


def test_no_slo_means_no_goodput() -> None:
    assert summarize([STEADY], 1.0, SLO()).goodput is None


def _replay(events: list[bytes], mode: str = "completions") -> RequestRecord:
    """The client against a canned SSE body: the server faults below can't be caused on demand. messages:
    each event's `event:` line too, as Anthropic's streams have them."""

    def frame(e: bytes) -> bytes:
        name = b"event: " + json.loads(e)["type"].encode() + b"\n" if mode == "messages" else b""
        return name + b"data: " + e + b"\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"".join(frame(e) for e in events))

    async def go() -> RequestRecord:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            spec = Spec(concurrency=[1], mode=mode, dataset="random" if mode == "completions" else "builtin")
            return await send(client, Endpoint("http://x", "m"), Prompt([1, 2, 3], 3, 4), spec)

    return asyncio.run(go())


def test_client_counts_chunks_and_usage() -> None:
    chunk = b'{"choices": [{"index": 0, "text": "ab"}]}'
    usage = b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}'
    r = _replay([chunk, chunk, usage, b"[DONE]"])
    assert r.success and r.error == ""
    assert (r.prompt_tokens, r.output_tokens, len(r.itl)) == (3, 4, 1)
    assert 0 < r.ttft <= r.latency


def test_client_splits_events_only_where_sse_ends_a_line() -> None:
    """A chunk whose text holds U+0085, U+2028 and U+2029 (JSON leaves them unescaped; str.splitlines, and
    so httpx's aiter_lines, splits at them) is one event."""
    chunk = '{"choices": [{"index": 0, "text": "a\u0085b\u2028c\u2029d"}]}'.encode()
    usage = b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}'
    r = _replay([chunk, chunk, usage, b"[DONE]"])
    assert r.success and r.error == ""
    assert (r.output_tokens, len(r.itl)) == (2, 1)


def test_client_records_a_failure_mid_stream() -> None:
    chunk = b'{"choices": [{"index": 0, "text": "ab"}]}'
    error = b'{"error": {"message": "the engine has died", "type": "ServiceUnavailableError", "code": 503}}'
    r = _replay([chunk, error, b"[DONE]"])
    assert not r.success and r.error == "error event: the engine has died"


def test_client_reads_chat_and_messages_streams() -> None:
    """Chat: the role chunk that opens a stream is no output. Messages: each content_block_delta is, and
    message_delta's usage counts the prompt with its cache reads."""
    role = b'{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}'
    text = b'{"choices": [{"index": 0, "delta": {"content": "ab"}}]}'
    usage = b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}'
    r = _replay([role, text, text, usage, b"[DONE]"], "chat")
    assert r.success and (r.prompt_tokens, r.output_tokens, len(r.itl)) == (3, 2, 1)
    events = [
        b'{"type": "message_start", "message": {"usage": {"input_tokens": 3, "output_tokens": 1}}}',
        b'{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}',
        *[b'{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ab"}}'] * 3,
        b'{"type": "content_block_stop", "index": 0}',
        b'{"type": "message_delta", "delta": {"stop_reason": "max_tokens"},'
        b' "usage": {"input_tokens": 1, "output_tokens": 3, "cache_read_input_tokens": 2}}',
        b'{"type": "message_stop"}',
    ]
    r = _replay(events, "messages")
    assert r.success and (r.prompt_tokens, r.output_tokens, len(r.itl)) == (3, 3, 2)
    error = b'{"type": "error", "error": {"type": "overloaded_error", "message": "queue full"}}'
    r = _replay([*events[:3], error], "messages")
    assert not r.success and r.error == "error event: queue full"
    with pytest.raises(ValueError, match="mode chat sends text"):
        Spec(concurrency=[1], mode="chat")


def test_range_ratio_draws_lengths_across_the_whole_range() -> None:
    spec = Spec(concurrency=[1], range_ratio=(7 / 9, 0.6))  # input 64..512, output 64..256 around 288, 160
    prompts = make_prompts(spec, 288, 160, 2000, random.Random(0), vocab_size=1000)
    inputs = [p.length for p in prompts]
    outputs = [p.max_tokens for p in prompts]
    assert all(len(p.prompt) == p.length for p in prompts)
    assert (min(inputs), max(inputs), min(outputs), max(outputs)) == (64, 512, 64, 256)
    # Uniform: each quarter of the input range holds about a quarter of the draws (500 +- 4 sigma).
    quarters = [sum(64 + 112 * q <= n < 64 + 112 * (q + 1) for n in inputs) for q in range(4)]
    assert all(abs(c - 500) < 80 for c in quarters), quarters
    fixed = make_prompts(Spec(concurrency=[1]), 128, 32, 5, random.Random(0))
    assert {(p.length, p.max_tokens) for p in fixed} == {(128, 32)}
