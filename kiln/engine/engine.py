"""The engine core: admits requests, runs steps (schedule -> execute -> update), and reports outputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from kiln.compile.cache import CompileCache, point_caches
from kiln.compile.reports import BucketReport
from kiln.config import EngineConfig
from kiln.engine.admission import Admission
from kiln.engine.bad_words import BadWords
from kiln.engine.block_manager import BlockManager
from kiln.engine.build import build_model, model_shape
from kiln.engine.dummy_steps import DummySteps
from kiln.engine.grammar import Grammars
from kiln.engine.lora_slots import LoraSlots
from kiln.engine.memory import kv_cache_blocks
from kiln.engine.output import OutputProcessor, Parent
from kiln.engine.pooler import resolve_pooler
from kiln.engine.prompt_embeds import GivenPrompt
from kiln.engine.request_output import RequestOutput
from kiln.engine.runner import ModelRunner
from kiln.engine.scheduler import ScheduledBatch, Scheduler
from kiln.engine.speculative import Drafter
from kiln.engine.step_result import StepResult
from kiln.engine.thinking import ThinkTags
from kiln.engine.tokenizer import eos_token_ids, load_tokenizer, sampling_defaults
from kiln.lora_request import LoRARequest
from kiln.models.loader import resolve_model
from kiln.models.registry import headless
from kiln.ops.cpu import threads
from kiln.paths import cache_root
from kiln.platform import resolve_device
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, own_thread: bool = False) -> None:
        """own_thread: the engine runs on a thread of kiln's own (the server's), which
        backend.cpu_threads_bind "auto" pins."""
        config.check_supported()
        clock = time.perf_counter()
        path = resolve_model(config.model.model)
        device = resolve_device(config.model.device)
        # Streams, events and Triton's launches follow the thread's current device: on cuda:1 they would
        # otherwise run on cuda:0, and an event that means "step N's tokens landed" would not.
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        config = msgspec.structs.replace(config, cache=config.cache.on(device.type))
        point_caches(cache_root())
        b = config.backend
        # Pinned once warm (Inductor's compile workers, started by this thread, keep every core); the
        # thread count is set now, as Inductor writes it into the code it generates.
        self.pinned = threads.resolve(b.cpu_threads_bind, own_thread) if device.type == "cpu" else None
        if self.pinned is not None:
            torch.set_num_threads(len(self.pinned))
        shape = model_shape(config, path, device)
        self.config = config = shape.config
        dims, self.max_model_len = shape.dims, shape.max_model_len
        built = build_model(shape, path, device)
        self.backend, self.model = built.backend, built.model
        self.timings = {"kernels": built.kernels_s, "weights": time.perf_counter() - clock - built.kernels_s}
        clock = time.perf_counter()
        self.tokenizer = load_tokenizer(config, path)
        self.timings["tokenizer"] = time.perf_counter() - clock
        clock = time.perf_counter()
        self.model_path = path
        self.eos_token_ids = eos_token_ids(self.tokenizer, path)
        self.sampling_defaults = sampling_defaults(config, path)
        compact = config.model.structured_outputs_config.disable_any_whitespace
        self.grammars = Grammars(
            lambda: load_tokenizer(config, path), dims.vocab_size, self.eos_token_ids, compact
        )
        self.pooler = resolve_pooler(
            config.model, path, dims.hidden_size, headless(shape.spec), self.model.score
        )
        self.runner = ModelRunner(
            self.model, config, self.max_model_len, self.backend, self.grammars, self.pooler is not None,
            built.kv_dtype,
        )  # fmt: skip
        parser = config.model.reasoning_parser
        self.admission = Admission(
            self.tokenizer,
            self.grammars,
            self.eos_token_ids,
            dims.vocab_size,
            self.max_model_len,
            config.scheduler.policy,
            dims.vocab_size if config.model.max_logprobs == -1 else config.model.max_logprobs,
            self.runner.device,
            None if parser is None else ThinkTags.of(parser, self.tokenizer),
            config.model.structured_outputs_config.enable_in_reasoning,
            self.pooler,
            config.model.enable_prompt_embeds,
            dims.hidden_size,
            self.runner.dtype,
            self.model.embed,
        )
        self.timings["runner"] = time.perf_counter() - clock
        num_blocks = kv_cache_blocks(config, self.runner, self.max_model_len, self.timings)
        clock = time.perf_counter()
        self.runner.allocate_kv(num_blocks)
        cache, sched = config.cache, config.scheduler
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        chunk = sched.prefill_chunk(device.type, self.backend.tiles(shape.dtype))
        speculative = sched.speculative_config
        drafter = None if speculative is None else Drafter(speculative)
        loras = config.lora.max_loras if config.lora.enable_lora else None
        self.scheduler = Scheduler(sched, self.block_manager, chunk, loras, drafter)
        self.async_scheduling = sched.use_async(device.type)
        self.in_flight: StepResult | None = None  # the launched step whose outputs are not yet processed
        self.drafts = drafter and drafter.stats  # speculative decoding's counters
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.scheduler.finish, self.drafts)
        self.timings["KV cache"] = time.perf_counter() - clock
        log.info(
            "engine ready: %s (%s), %d KV blocks of %d tokens (%s), max_model_len %d; kernels %s, "
            "attention %s, sampler %s; async scheduling %s; speculative decoding %s",
            self.model.spec.name,
            self.model.embed.weight.dtype,
            num_blocks,
            config.cache.block_size,
            str(built.kv_dtype).removeprefix("torch."),
            self.max_model_len,
            self.backend.kernels,
            self.backend.attention,
            self.backend.sampler,
            "on" if self.async_scheduling else "off",
            "off" if speculative is None else speculative.summary,
        )

    def warmup(self, progress: bool = False) -> list[BucketReport]:
        """Builds every graph and kernel before the first request (DummySteps.warmup), timing each part."""
        cache_file = self.config.compile.cache_file
        cache = None if cache_file is None else Path(cache_file)
        reports, timings = DummySteps(self.runner).warmup(progress, cache)
        self.timings.update(timings)
        if self.pinned is not None:
            threads.bind(self.pinned)
        return reports

    @property
    def compile_cache(self) -> CompileCache:
        cache = self.runner.lowering.compile_cache
        assert cache is not None, "warmup() makes the compile cache entry"
        return cache

    # -- admission ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | GivenPrompt,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        checked: BadWords | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        """Validates, then queues; raises ValueError (and queues nothing) for a bad prompt, params or
        options. PoolingParams ask for the prompt's embedding (a pooling model's only kind of request).
        priority: smaller is scheduled sooner (policy "priority"); cache_salt: only requests with the same
        salt share prefix-cache blocks. checked: what Admission.check_params returned for these
        params and options, where a caller checked them already (AsyncEngine, on its event loop). lora:
        the adapter it runs with (read now, unless the engine holds it)."""
        if request_id in self.output.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        admission = self.admission
        bad_words = checked
        if bad_words is None:
            admission.check_options(priority, cache_salt)
            bad_words = admission.check_params(params)
        if lora is not None:
            self.loras.load(lora)
        if isinstance(prompt, GivenPrompt):
            ids, embeds = admission.embeds_prompt(prompt, params)
            assert isinstance(params, SamplingParams)  # (embeds_prompt refuses pooling)
            children = admission.requests(request_id, ids, params, bad_words, priority, cache_salt, embeds)
        elif isinstance(params, PoolingParams):
            ids = admission.tokenize(prompt, params)
            children = [admission.pooled_request(request_id, ids, params, priority, cache_salt)]
        else:
            ids = admission.tokenize(prompt, params)
            children = admission.requests(request_id, ids, params, bad_words, priority, cache_salt)
        for child in children:
            child.lora = lora
        parent = Parent(request_id, prompt if isinstance(prompt, str) else None, children)
        self.output.parents[request_id] = parent
        for child in children:
            self.scheduler.add(child)

    @property
    def loras(self) -> LoraSlots:
        """The adapter slots (ValueError where the engine was made without them)."""
        if self.runner.loras is None:
            raise ValueError("LoRA is not enabled (--enable-lora)")
        return self.runner.loras

    def abort(self, request_id: str) -> None:
        parent = self.output.parents.pop(request_id, None)
        for child in parent.children if parent else []:
            if not child.finished:
                self.scheduler.finish(child)
                child.finish_reason = "abort"

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: forgets every cached prefix; False while running requests hold blocks, unless asked to
        preempt them (they recompute), which a step in flight defers (False: a caller may retry)."""
        if reset_running_requests and self.in_flight is None:
            self.scheduler.preempt_running()
        return self.block_manager.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    # -- the step -----------------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step: schedule, launch, then the outputs of the requests it advanced (deltas; with
        final_only, only the whole outputs of requests it finished). Under async scheduling those come
        from the step before, landed while this one runs."""
        outputs: list[RequestOutput] = []
        last, self.in_flight = self.in_flight, None
        batch = self.scheduler.schedule()
        if batch.requests:
            land = None
            if last is not None and last.read_next:
                # This step's bitmasks and bad words need the last one's tokens: they land while its
                # forward runs.
                landing, last = last, None

                def land() -> None:
                    outputs.extend(self.output.process(landing, final_only))

            result = self._launch(batch, land)
            if self.async_scheduling:
                self.in_flight = result
            else:
                outputs += self.output.process(result, final_only)
        elif last is None:  # every waiting request waits for its grammar
            self.grammars.wait(timeout=0.05)
        if last is not None:
            outputs += self.output.process(last, final_only)
        return outputs

    def _launch(self, batch: ScheduledBatch, land: Callable[[], None] | None = None) -> StepResult:
        result = self.runner.execute(batch, land)
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            req.num_computed_tokens += n
            if not req.finished:  # one that land() finished has freed its blocks
                self.block_manager.cache_full_blocks(req)
        for req in result.sampled:
            req.num_pending += 1
        for req in result.pooled:  # its prompt is done: its blocks are free for the next step
            req.finish_reason = "stop"
            self.scheduler.finish(req)
        return result

    @property
    def cache_info(self) -> dict[str, str]:
        """vLLM's cache_config_info labels (its CacheConfig's fields as strings), for the ones kiln has."""
        c, blocks = self.config.cache, self.block_manager.num_blocks
        gib = c.kv_cache_gib
        fields = {
            "block_size": c.block_size,
            "cache_dtype": c.kv_cache_dtype,
            "enable_prefix_caching": c.enable_prefix_caching,
            "gpu_memory_utilization": c.gpu_memory_utilization,
            "kv_cache_memory_bytes": None if gib is None else int(gib * 2**30),
            "num_gpu_blocks": blocks,
            "num_gpu_blocks_override": c.num_gpu_blocks_override,
            "kv_cache_size_tokens": blocks * (c.block_size or 0),
        }
        return {key: str(value) for key, value in fields.items()}

    def stats(self) -> dict[str, Any]:
        s, loras = self.scheduler, self.runner.loras
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "deferred": s.num_deferred,
            "kv_cache_usage": self.block_manager.usage,
            "prefix_cache_queries": self.block_manager.prefix_queries,
            "prefix_cache_hits": self.block_manager.prefix_hits,
            "preemptions": s.num_preemptions,
            "grammars": self.grammars.stats,
            "lora": None if loras is None else loras.requests_info(s.running, s.waiting),
            "drafts": self.drafts,
            "cache_config": self.cache_info,
        }
