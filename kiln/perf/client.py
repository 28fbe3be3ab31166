"""The load generator: streams requests (to /v1/completions, /v1/chat/completions or /v1/messages, as the
spec's mode says) at a fixed concurrency or a Poisson rate."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from kiln.perf.dataset import Prompt
from kiln.perf.metrics import RequestRecord
from kiln.perf.spec import Spec


@dataclass(slots=True)
class Endpoint:
    base_url: str  # e.g. http://127.0.0.1:8000 (without /v1)
    model: str
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines, ended as SSE ends them (LF, CRLF or CR). httpx's aiter_lines follows
    str.splitlines, which also splits at U+0085, U+2028 and U+2029: JSON strings carry those unescaped, so a
    sampled token's text would cut its event in two."""
    rest = b""
    async for part in response.aiter_bytes():
        *lines, rest = re.split(rb"\r\n|\n|\r", rest + part)
        for line in lines:
            yield line.decode()
    if rest:
        yield rest.decode()


def request(ep: Endpoint, prompt: Prompt, spec: Spec) -> tuple[str, dict[str, Any]]:
    """The path and body of one streamed request in the spec's mode."""
    body: dict[str, Any] = {
        "model": ep.model,
        "max_tokens": prompt.max_tokens,
        "temperature": spec.temperature,
        "stream": True,
    }
    if spec.mode == "messages":
        return "/v1/messages", {
            **body,
            "messages": [{"role": "user", "content": prompt.prompt}],
            **spec.extra_body,
        }
    body |= {"ignore_eos": spec.ignore_eos, "stream_options": {"include_usage": True}}
    if spec.mode == "chat":
        return "/v1/chat/completions", {
            **body,
            "messages": [{"role": "user", "content": prompt.prompt}],
            **spec.extra_body,
        }
    return "/v1/completions", {**body, "prompt": prompt.prompt, **spec.extra_body}


@dataclass(slots=True)
class Event:
    """What one streamed event says: an error, new output, or the usage (prompt, output tokens)."""

    error: str | None = None
    output: bool = False
    usage: tuple[int, int] | None = None
    end: bool = False


def read_event(data: str, mode: str) -> Event:
    """One `data:` line of a stream in this mode."""
    if data == "[DONE]":
        return Event(end=True)
    event = json.loads(data)
    if "error" in event:
        error = event["error"]
        return Event(
            error=f"error event: {error.get('message', error) if isinstance(error, dict) else error}"
        )
    if mode == "messages":
        kind = event["type"]
        usage = event["usage"] if kind == "message_delta" else None
        # input_tokens leaves out cache reads, which these servers report only with prompt-token details.
        counts = (
            (usage["input_tokens"] + usage.get("cache_read_input_tokens", 0), usage["output_tokens"])
            if usage
            else None
        )
        return Event(output=kind == "content_block_delta", usage=counts, end=kind == "message_stop")
    usage = event.get("usage")
    counts = (usage["prompt_tokens"], usage["completion_tokens"]) if usage else None
    if not event.get("choices"):
        return Event(usage=counts)
    choice = event["choices"][0]
    text = choice.get("text") if mode == "completions" else (choice.get("delta") or {}).get("content")
    # A chat stream opens with a role chunk and may close with an empty one: no output there.
    return Event(output=mode == "completions" or bool(text))


async def send(client: httpx.AsyncClient, ep: Endpoint, prompt: Prompt, spec: Spec) -> RequestRecord:
    path, body = request(ep, prompt, spec)
    record = RequestRecord(prompt_tokens=prompt.length or 0)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body, headers=ep.headers()) as r:
            if r.status_code != 200:
                await r.aread()
                record.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return record
            async for line in sse_lines(r):
                if not line.startswith("data: "):
                    continue  # blank lines, comments, Anthropic's `event:` lines
                now = time.perf_counter()
                event = read_event(line[6:], spec.mode)
                if event.error is not None:
                    record.error = event.error
                    return record
                if event.output:
                    if record.ttft == 0.0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                if event.usage is not None:
                    record.prompt_tokens = prompt.length or event.usage[0]
                    record.output_tokens = event.usage[1]
                if event.end:
                    break
        record.latency = time.perf_counter() - start
        record.success = record.ttft > 0.0 and record.output_tokens > 0
        if not record.success:
            record.error = "the stream ended without output or usage"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        record.error = f"{type(e).__name__}: {e}"
    return record


def arrival_gaps(rate: float, burstiness: float, n: int, rng: random.Random) -> list[float]:
    """Gamma-distributed gaps with mean 1/rate; shape 1 (burstiness 1) is a Poisson process."""
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def run_load(
    ep: Endpoint,
    prompts: list[Prompt],
    spec: Spec,
    load: tuple[str, float],
    rng: random.Random,
    desc: str,
) -> tuple[list[RequestRecord], float]:
    """Sends every prompt under the given load; returns the records (in prompt order) and the wall time."""
    kind, value = load
    limit = int(value) if kind == "concurrency" else (spec.max_concurrency or len(prompts))
    gaps = arrival_gaps(value, spec.burstiness, len(prompts), rng) if kind == "request_rate" else None
    gate = asyncio.Semaphore(limit)
    timeout = httpx.Timeout(None, connect=30)
    async with httpx.AsyncClient(
        base_url=ep.base_url, timeout=timeout, limits=httpx.Limits(max_connections=limit + 4)
    ) as client:
        with tqdm(total=len(prompts), desc=desc, unit="req", leave=False) as bar:

            async def one(p: Prompt) -> RequestRecord:
                async with gate:
                    record = await send(client, ep, p, spec)
                bar.update()
                return record

            start = time.perf_counter()
            tasks = []
            for i, p in enumerate(prompts):
                if gaps is not None and i:
                    await asyncio.sleep(gaps[i])
                tasks.append(asyncio.create_task(one(p)))
            records = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
    return list(records), duration
