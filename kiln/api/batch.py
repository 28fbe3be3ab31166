"""`kiln run-batch`, vLLM's run-batch: an OpenAI batch file (one `{"custom_id", "method", "url", "body"}`
request a line) run through the server's own app in-process, every request at once, and one result a
line in the input's order. Input and output may be local files or http(s) URLs (GET and PUT)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from typing import Any

import httpx
import msgspec
import prometheus_client
from tqdm import tqdm

from kiln.api.app import App
from kiln.api.errors import APIError
from kiln.api.routes import ANTHROPIC, WORK
from kiln.server_config import ServeConfig

log = logging.getLogger(__name__)

# The paths a line may name: every one that runs the model, each with one JSON reply (a stream is
# refused, as vLLM refuses it).
PATHS = [path for path, _, _ in WORK + ANTHROPIC]


class BatchError(Exception):
    """An input file that cannot run: the message names the file (and the line)."""


class BatchRequest(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class BatchResponse(msgspec.Struct):
    status_code: int
    request_id: str
    body: Any


class BatchResult(msgspec.Struct):
    """One output line. A refused request has its error in `error` (vLLM's place) and in the response's
    body (the OpenAI Batch API's)."""

    id: str
    custom_id: str
    response: BatchResponse
    error: Any


def parse(text: str, where: str) -> list[BatchRequest]:
    requests = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            requests.append(msgspec.json.decode(line, type=BatchRequest))
        except msgspec.DecodeError as e:
            raise BatchError(f"{where} line {n}: {e}") from None
    if not requests:
        raise BatchError(f"{where} holds no requests")
    return requests


async def read(source: str) -> str:
    if source.startswith(("http://", "https://")):
        async with httpx.AsyncClient(timeout=300) as client:
            response = await client.get(source)
        if response.status_code != 200:
            raise BatchError(f"GET {source}: HTTP {response.status_code}")
        return response.text
    try:
        with open(source, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise BatchError(f"cannot read {source}: {e.strerror}") from None


async def write(target: str, data: bytes) -> None:
    if target.startswith(("http://", "https://")):
        async with httpx.AsyncClient(timeout=1000) as client:
            response = await client.put(target, content=data)
        if not 200 <= response.status_code < 300:
            raise BatchError(f"PUT {target}: HTTP {response.status_code}: {response.text[:300]}")
        return
    try:
        with open(target, "wb") as f:
            f.write(data)
    except OSError as e:
        raise BatchError(f"cannot write {target}: {e.strerror}") from None


async def run_batch(config: ServeConfig, source: str, target: str, metrics: bool = False) -> int:
    """Exit status: 0 once every line has its result written (failed requests included), 1 if the engine
    did not start. BatchError for input or output that cannot be read or written. metrics: Prometheus
    metrics on server.host and port while the batch runs (vLLM's --enable-metrics)."""
    requests = parse(await read(source), source)
    app = App(config, listening=False)
    async with app.starlette.router.lifespan_context(app.starlette):
        while app.engine is None and not app.stopped.is_set():
            await asyncio.sleep(0.05)
        if app.engine is None:
            return app.exit_code
        if metrics:
            s = config.server
            prometheus_client.start_http_server(s.port, s.host, registry=app.engine.metrics.registry)
            log.info("metrics at http://%s:%d/metrics", s.host, s.port)
        keys = config.server.api_keys
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        transport = httpx.ASGITransport(app=app.starlette)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln", headers=headers) as client:
            with tqdm(total=len(requests), desc="Running batch", unit="req") as bar:

                async def one(r: BatchRequest) -> BatchResult:
                    result = await _run(client, r)
                    bar.update()
                    return result

                results = await asyncio.gather(*map(one, requests))
    await write(target, b"".join(msgspec.json.encode(r) + b"\n" for r in results))
    codes = Counter(r.response.status_code for r in results)
    log.info(
        "%d requests: %s; results in %s",
        len(results),
        ", ".join(f"{n} with status {code}" for code, n in sorted(codes.items())),
        target,
    )
    return 0


async def _run(client: httpx.AsyncClient, r: BatchRequest) -> BatchResult:
    if r.method.upper() != "POST":
        return _refused(r, APIError(400, f"method {r.method!r}: only POST is supported", "method"))
    if r.url not in PATHS:
        message = f"url {r.url!r} is not supported; supported: {', '.join(PATHS)}"
        return _refused(r, APIError(400, message, "url"))
    if r.body.get("stream"):
        return _refused(r, APIError(400, "Request must not be sent in stream mode", "stream"))
    response = await client.post(r.url, json=r.body, timeout=None)
    body = response.json()
    request_id = f"kiln-batch-{uuid.uuid4().hex}"
    error = body if response.status_code >= 400 else None
    return BatchResult(_id(), r.custom_id, BatchResponse(response.status_code, request_id, body), error)


def _refused(r: BatchRequest, error: APIError) -> BatchResult:
    body = msgspec.to_builtins(error.body())
    return BatchResult(_id(), r.custom_id, BatchResponse(400, f"kiln-batch-{uuid.uuid4().hex}", body), body)


def _id() -> str:
    return f"kiln-{uuid.uuid4().hex}"
