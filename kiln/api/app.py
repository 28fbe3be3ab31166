"""The HTTP app: routes, API-key check, body limits, readiness and draining around the AsyncEngine."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kiln.api.dev import DEV
from kiln.api.errors import APIError, as_api_error
from kiln.api.guard import authorize, read_body
from kiln.api.inputs import Inputs
from kiln.api.invocations import create_invocation
from kiln.api.load import ServerLoad
from kiln.api.middleware import middleware
from kiln.api.protocol import DetokenizeRequest, TokenizeRequest
from kiln.api.routes import ANTHROPIC, WORK, Handler
from kiln.api.served_models import LoadLoRAAdapterRequest, ServedModels, UnloadLoRAAdapterRequest, vllm_flag
from kiln.api.template_traits import template_traits
from kiln.api.tokenize import detokenize, tokenize
from kiln.api.tokenizer_info import tokenizer_info
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.stats_log import log_stats
from kiln.ops.cpu import threads
from kiln.server_config import ServeConfig
from kiln.version import VERSION

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

_encoder = msgspec.json.Encoder()


class App:
    def __init__(
        self, config: ServeConfig, started: float | None = None, imports: float = 0.0, listening: bool = True
    ) -> None:
        """started: the process's clock at launch (perf_counter); imports: seconds spent importing the
        serving stack (the ready line's first part); listening: on server.host and port (run-batch: not)."""
        self.config = config
        self.listening = listening
        model = config.model.model
        served = config.server.served_model_name
        # As vLLM: a request may name the model by any of these; responses carry the first.
        names = [served] if isinstance(served, str) else served or []
        self.models = ServedModels(names or [DEFAULT_MODEL_NAME if model == "default" else model])
        self.model_name = self.models.name
        self.started = time.perf_counter() if started is None else started
        self.imports = imports
        self.engine: AsyncEngine | None = None
        self.inputs: Inputs | None = None  # built with the engine: it needs the tokenizer
        self.stats_task: asyncio.Task[None] | None = None
        self.draining = False
        self.stopped = asyncio.Event()  # set when the server should close
        self.exit_code = 0
        self.load = ServerLoad()
        post, get = ["POST"], ["GET"]
        invoke = functools.partial(create_invocation, check_model=self._check_model)
        info = [("/tokenizer_info", tokenizer_info)] if config.server.enable_tokenizer_info_endpoint else []
        loras = [
            ("/v1/load_lora_adapter", self.models.load, LoadLoRAAdapterRequest),
            ("/v1/unload_lora_adapter", self.models.unload, UnloadLoRAAdapterRequest),
        ]
        self.starlette = Starlette(
            routes=[
                *(Route(p, self._api(p, h, kind, counted=True), methods=post) for p, h, kind in WORK),
                *(
                    Route(p, self._api(p, h, kind, counted=True, anthropic=True), methods=post)
                    for p, h, kind in ANTHROPIC
                ),
                Route("/v1/models", self._api("/v1/models", self.models.list), methods=get),
                Route("/tokenize", self._api("/tokenize", tokenize, TokenizeRequest), methods=post),
                Route("/detokenize", self._api("/detokenize", detokenize, DetokenizeRequest), methods=post),
                *(Route(p, self._api(p, h), methods=get) for p, h in info),
                *(
                    Route(p, self._api(p, h, kind), methods=post)
                    for p, h, kind in loras
                    if vllm_flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
                ),
                *(
                    Route(p, self._api(p, h), methods=[m])
                    for p, h, m in DEV
                    if vllm_flag("VLLM_SERVER_DEV_MODE")
                ),
                Route("/health", self._health, methods=get),
                Route("/ping", self._health, methods=["GET", "POST"]),  # SageMaker's, as vLLM
                Route("/invocations", self._api("/invocations", invoke, msgspec.Raw), methods=post),
                Route("/metrics", self._metrics, methods=get),
                Route("/load", self.load.endpoint, methods=get),
                Route("/version", self._version, methods=get),
            ],
            exception_handlers={HTTPException: self._http_error},
            lifespan=self._lifespan,
            middleware=middleware(config.server),
        )

    # -- lifecycle -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: Starlette) -> AsyncIterator[None]:
        # The engine loads in the background, so the port answers 503 (not "connection refused") meanwhile.
        start = asyncio.create_task(self._start_engine())
        yield
        start.cancel()
        if self.stats_task is not None:
            self.stats_task.cancel()
        if self.inputs is not None:
            self.inputs.close()
        if self.engine is not None:
            await self.engine.shutdown()

    async def _start_engine(self) -> None:
        try:
            engine = await AsyncEngine.start(self.config, self.model_name)
        except Exception:
            log.exception("the engine failed to start")
            self.exit_code = 1
            self.stopped.set()
            return
        try:
            for m in self.config.server.lora_modules:
                await self.models.add(engine, m.name, m.path, m.base_model_name)
        except ValueError as e:
            log.error("--lora-modules: %s", e)
            await engine.shutdown()
            self.exit_code = 1
            self.stopped.set()
            return
        traits = functools.cache(functools.partial(template_traits, engine.tokenizer, self.config.server))
        self.inputs = Inputs(
            engine.tokenizer,
            engine.vocab_size,
            engine.max_model_len,
            engine.admission.check_prompt,
            self.config.server,
            traits,
            engine.admission.hidden_size if engine.admission.prompt_embeds else None,
        )
        self.engine = engine
        threads.yield_to_engine(self.config.server.loop_nice)
        self._log_ready()
        if not self.config.server.disable_log_stats:
            every = self.config.server.log_stats_interval
            self.stats_task = asyncio.create_task(log_stats(engine.metrics, engine.engine.stats, every))

    def _log_ready(self) -> None:
        assert self.engine is not None
        s = self.config.server
        url = f"unix:{s.uds}" if s.uds else f"{'https' if s.ssl_certfile else 'http'}://{s.host}:{s.port}"
        total = time.perf_counter() - self.started
        timings = {"imports": self.imports, **self.engine.timings}
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in timings.items())
        parts += f", other {total - sum(timings.values()):.2f} s (the server's own start)"
        where = f"at {url}" if self.listening else "in-process"
        log.info(
            "kiln is ready %s, serving %s, %.1f s after start (%s)", where, self.model_name, total, parts
        )
        if not self.listening:
            return
        auth = f" -H 'Authorization: Bearer {s.api_keys[0]}'" if s.api_keys else ""
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello!"}]}
        if self.inputs is not None and not self.inputs.has_tokenizer:  # token ids in, token ids out
            path, body = "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8, "return_token_ids": True}
        log.info(
            "try: curl %s%s -H 'Content-Type: application/json'%s -d '%s'",
            url,
            path,
            auth,
            _encoder.encode({"model": self.model_name, **body}).decode(),
        )

    def begin_drain(self) -> None:
        """SIGTERM/SIGINT: refuse new requests, let those in flight finish, then stop. A second signal
        stops at once."""
        if self.draining:
            log.warning("second signal: stopping now")
            self.stopped.set()
            return
        self.draining = True
        asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.server.drain_timeout
        if self.engine is not None and self.engine.num_in_flight:
            log.info(
                "draining %d requests in flight (timeout %.0f s)",
                self.engine.num_in_flight,
                deadline - loop.time(),
            )
        while self.engine is not None and self.engine.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.engine is not None and self.engine.num_in_flight:
            log.warning("drain timed out; aborting %d requests", self.engine.num_in_flight)
            await self.engine.shutdown()
        self.stopped.set()

    # -- request plumbing ---------------------------------------------------------------------

    def _ready(self) -> tuple[AsyncEngine, Inputs]:
        if self.draining:
            raise APIError(503, "kiln is shutting down and accepts no new requests")
        if self.engine is None or self.inputs is None:
            raise APIError(503, "kiln is starting: the model is still loading")
        if self.engine.dead is not None:
            raise APIError(503, f"the engine has died: {self.engine.dead!r}")
        return self.engine, self.inputs

    def _check_model(self, body: Any) -> None:
        self.models.check(getattr(body, "model", None), self.engine)

    def _api(
        self,
        path: str,
        handler: Handler,
        kind: type | None = None,
        counted: bool = False,
        anthropic: bool = False,
    ) -> Callable[[Request], Awaitable[Response]]:
        """anthropic: Anthropic's errors and keys (/v1/messages)."""
        guarded = path.startswith("/v1/") or path == "/invocations"
        if counted and self.config.server.enable_server_load_tracking:
            return self.load.counted(self._api(path, handler, kind, anthropic=anthropic))

        async def endpoint(request: Request) -> Response:
            try:
                if guarded:
                    authorize(request, self.config.server.api_keys, anthropic)
                engine, shared = self._ready()
                data = await read_body(request, self.config.server.max_request_bytes) if kind else b""
                inputs = shared.for_body(len(data))
                body = await inputs.parse(data, kind) if kind is not None else None
                self._check_model(body)
                result = await handler(engine, inputs, request, body)
            except Exception as e:
                error = as_api_error(e)
                if self.config.server.log_error_stack:
                    log.error("%s %s: %d %s", request.method, path, error.status, error.message, exc_info=e)
                return error.response(anthropic)
            if isinstance(result, Response):
                return result
            if result is None:  # the client went away; nobody reads this
                return Response(status_code=499)
            return Response(_encoder.encode(result), media_type="application/json")

        return endpoint

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return APIError(404, f"no route for {request.method} {request.url.path}").response()
        return APIError(exc.status_code, str(exc.detail)).response()

    # -- small endpoints ------------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        try:
            self._ready()
        except APIError as e:
            return e.response()
        return Response(status_code=200)

    async def _metrics(self, request: Request) -> Response:
        if self.engine is None:
            return APIError(503, "kiln is starting: the model is still loading").response()
        return Response(self.engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _version(self, request: Request) -> Response:
        return Response(_encoder.encode({"version": VERSION}), media_type="application/json")
