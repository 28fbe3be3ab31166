"""AsyncEngine: LLMEngine behind asyncio. The engine steps in a thread of its own, so the event loop that
serves HTTP never waits on a model step; the two talk through a command queue one way and
`call_soon_threadsafe` the other."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.config import EngineConfig
from kiln.engine.admission import Admission
from kiln.engine.commands import Abort, Add, Lora, ResetPrefixCache
from kiln.engine.engine import LLMEngine
from kiln.engine.metrics import Metrics
from kiln.engine.pause import Pause, PauseMode, Pausing, Resuming
from kiln.engine.pooler import Pooler
from kiln.engine.prompt_embeds import GivenPrompt
from kiln.engine.queue_limits import Overloaded, QueueLimits
from kiln.engine.request_output import RequestOutput
from kiln.engine.request_stream import RequestStream
from kiln.engine.tokenizer import load_tokenizer
from kiln.lora_request import LoRARequest
from kiln.models.lora_adapter import load_adapter
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


_STOP = object()


class AsyncEngine:
    """Build with `await AsyncEngine.start(config, model_name)` on the event loop that will use it."""

    engine: LLMEngine
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    sampling_defaults: dict[str, Any]  # the model's generation config, for fields a request leaves unset
    admission: Admission  # the engine's checks, with the event loop's tokenizer
    reasoning_parser: str | None  # model.reasoning_parser
    pooler: Pooler | None  # a pooling model's (runner pooling): it serves embeddings only
    model_path: Path
    timings: dict[str, float]  # start-up, by part
    metrics: Metrics

    def __init__(self, config: EngineConfig, model_name: str) -> None:
        self.model_name = model_name
        self.dead: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._built: asyncio.Future[LLMEngine] = self._loop.create_future()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._queue = QueueLimits(config.scheduler)
        self.served_loras: dict[str, LoRARequest] = {}  # by the name a request's `model` gives (kiln.api)
        self.paused = False  # between pause() and resume()
        self._pause = Pause()  # the engine thread's
        self._thread = threading.Thread(target=self._run, args=(config,), name="kiln-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def start(cls, config: EngineConfig, model_name: str) -> AsyncEngine:
        self = cls(config, model_name)
        self.engine = await self._built
        # The event loop's own tokenizer: a fast tokenizer is not safe to share with the engine thread.
        self.tokenizer = load_tokenizer(config, self.engine.model_path)
        self.admission = dataclasses.replace(self.engine.admission, tokenizer=self.tokenizer)
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.model.dims.vocab_size
        self.eos_token_ids = frozenset(self.engine.eos_token_ids)
        self.sampling_defaults = self.engine.sampling_defaults
        self.reasoning_parser = config.model.reasoning_parser
        self.pooler = self.engine.pooler
        self.model_path = self.engine.model_path
        self.timings = self.engine.timings
        self.metrics = Metrics(model_name, self.engine.stats, self.max_model_len)
        return self

    def served_name(self, model: str | None) -> str:
        """The name a response gives: the adapter's a request named, else the model's first."""
        return model if model in self.served_loras else self.model_name

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def generate(
        self,
        prompt: list[int] | GivenPrompt,
        params: SamplingParams | PoolingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: LoRARequest | None = None,
    ) -> RequestStream:
        """Queues a request and returns its stream (options as LLMEngine.add_request; PoolingParams: its
        embedding). A bad prompt, params or options raise ValueError here, before anything is queued. The
        prompt: token ids or embeddings."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has died: {self.dead!r}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        admission = self.admission
        admission.check_options(priority, cache_salt)
        bad_words = admission.check_params(params)
        if isinstance(prompt, GivenPrompt):
            prompt = admission.check_embeds(prompt, params)
            prompt_ids = prompt.ids  # (placeholders where rows are given)
        else:
            prompt_ids = prompt
        admission.check_prompt(prompt_ids, isinstance(params, PoolingParams))
        stream = RequestStream(request_id, self.abort, params, prompt_token_ids=prompt_ids)
        tokens = len(prompt_ids) * stream.seqs  # as vLLM counts its n sequences
        try:
            self._queue.join(stream.seqs, tokens)
        except Overloaded as e:
            self.metrics.rejected(e.reason)
            raise
        stream.prefill_tokens = tokens
        self._streams[request_id] = stream
        self._commands.put(Add(request_id, prompt, params, priority, cache_salt, bad_words, lora))
        return stream

    async def add_lora(self, lora: LoRARequest) -> None:
        """Reads and checks an adapter off the event loop (ValueError, LoRA off too), then hands it to the
        engine."""
        adapter = await asyncio.to_thread(load_adapter, lora, self.engine.loras.model)
        self._commands.put(Lora(adapter))

    def remove_lora(self, lora_int_id: int) -> None:
        self._commands.put(Lora(None, lora_int_id))

    def _untrack(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._queue.leave(stream.seqs)
            self._prefilled(stream)
        return stream

    def _prefilled(self, stream: RequestStream) -> None:
        self._queue.prefilled(stream.prefill_tokens)
        stream.prefill_tokens = 0

    def check_constraint(self, params: StructuredOutputsParams) -> None:
        """Parses a constraint (thread-safe, cached): ValueError if it is bad."""
        self.admission.check_constraint(params)

    def abort(self, request_id: str) -> None:
        if self._untrack(request_id) is not None:
            self.metrics.finished("abort")
            self._commands.put(Abort(request_id))

    async def pause(self, mode: PauseMode, clear_cache: bool = True) -> None:
        """Returns once the pause holds (kiln.engine.pause); requests that come meanwhile wait for resume."""
        if mode == "abort":  # each generation ends with an "abort" output, as vLLM's; an embedding finishes
            for request_id, stream in list(self._streams.items()):
                if isinstance(stream.params, SamplingParams):
                    self.abort(request_id)
                    stream.queue.put_nowait(stream.aborted())
        self.paused = True
        await self._call(lambda done: Pausing(mode, clear_cache, lambda: done(None)))

    def resume(self) -> None:
        self.paused = False
        self._commands.put(Resuming())

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """LLMEngine.reset_prefix_cache, between two steps."""
        return await self._call(lambda done: ResetPrefixCache(reset_running_requests, done))

    def _call(self, command: Callable[[Callable[[Any], None]], Any]) -> asyncio.Future[Any]:
        """Queues the command `command(done)` makes; the future is done when the engine thread calls done."""
        future = self._loop.create_future()

        def resolve(value: Any) -> None:
            if not future.done():  # (its caller may have gone)
                future.set_result(value)

        self._commands.put(command(lambda value: self._loop.call_soon_threadsafe(resolve, value)))
        return future

    async def shutdown(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self, config: EngineConfig) -> None:
        # Every torch call (loading, warmup, steps) stays on this one thread: a second thread's OpenMP
        # pool makes libgomp throttle its spin-waits, which cost ~20% of decode speed on 2 cores.
        try:
            engine = LLMEngine(config, own_thread=True)
            engine.warmup()
        except Exception as e:
            self._loop.call_soon_threadsafe(self._resolve, None, e)
            return
        self._loop.call_soon_threadsafe(self._resolve, engine, None)
        pause = self._pause
        try:
            while True:
                for command in self._pending(block=pause.frozen or not engine.has_unfinished()):
                    if command is _STOP:
                        return
                    self._apply(engine, command)
                if engine.has_unfinished() and not pause.frozen:
                    outputs = engine.step()
                    if outputs:
                        self._loop.call_soon_threadsafe(self._dispatch, outputs, time.monotonic())
                pause.settle(engine)
        except BaseException as e:
            log.exception("engine step failed; the engine is dead")
            self._loop.call_soon_threadsafe(self._die, e)

    def _pending(self, block: bool) -> list[Any]:
        """Every queued command; when idle, first sleeps until one comes."""
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, engine: LLMEngine, command: Any) -> None:
        if isinstance(command, Abort):
            engine.abort(command.request_id)
            self._pause.drop(command.request_id)
            return
        if isinstance(command, Lora):
            engine.loras.keep(command.adapter) if command.adapter else engine.loras.drop(command.lora_int_id)
            return
        if isinstance(command, Pausing):
            self._pause.start(command, engine)
            return
        if isinstance(command, Resuming):
            for held in self._pause.resume():
                self._apply(engine, held)
            return
        if isinstance(command, ResetPrefixCache):
            command.done(engine.reset_prefix_cache(command.reset_running_requests))
            return
        if self._pause.hold(command):
            return
        try:
            c = command
            engine.add_request(
                c.request_id, c.prompt, c.params, c.priority, c.cache_salt, c.bad_words, c.lora
            )
        except ValueError as e:  # checked already on the event loop, so this is a race at most
            self._loop.call_soon_threadsafe(self._fail, command.request_id, e)

    # -- back on the event loop ---------------------------------------------------------------

    def _resolve(self, engine: LLMEngine | None, error: Exception | None) -> None:
        if self._built.done():  # start() was cancelled: the server is stopping
            return
        if error is not None:
            self._built.set_exception(error)
        else:
            self._built.set_result(engine)  # type: ignore[arg-type]

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        tokens = 0
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted while the step ran
                continue
            self._prefilled(stream)
            tokens += self.metrics.observe(stream, out, now)
            if out.finished:
                self._untrack(out.request_id)
            stream.queue.put_nowait(out)
        self.metrics.step(tokens)

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._untrack(request_id)
        if stream is not None:
            stream.queue.put_nowait(error)

    def _die(self, error: BaseException) -> None:
        self.dead = error
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(f"the engine has died: {error!r}"))
        self._streams.clear()
        self._queue.clear()
