"""The engine core: admits requests, runs steps (schedule -> execute -> update), and reports outputs."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
from transformers import AutoTokenizer, GenerationConfig

from kiln.compile.cache import CompileCache, key_parts, point_caches
from kiln.compile.lowering import BucketReport
from kiln.config import EngineConfig
from kiln.engine.block_manager import BlockManager
from kiln.engine.detokenizer import IncrementalDetokenizer, find_stop
from kiln.engine.memory import kv_cache_blocks
from kiln.engine.outputs import Parent, RequestOutput, logprob_dicts
from kiln.engine.request import Request
from kiln.engine.runner import ModelRunner, StepResult
from kiln.engine.scheduler import Scheduler
from kiln.models.loader import inspect_model, load_model, resolve_device, resolve_model
from kiln.ops.backend import choose_backend, kernels_for
from kiln.paths import cache_root
from kiln.sampling_params import SamplingParams

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # vLLM's default cap on logprobs and prompt_logprobs


def load_tokenizer(config: EngineConfig, model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(config.model.tokenizer or model_path, local_files_only=True)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.check_supported()
        self.config = config
        clock = time.perf_counter()
        path = resolve_model(config.model.model)
        device = resolve_device(config.model.device)
        point_caches(cache_root())
        b = config.backend
        _, dims, dtype = inspect_model(path, config.model.dtype)
        self.backend = choose_backend(b.kernels, b.attention, b.sampler, device, dims.head_dim, dtype)
        self.model = load_model(path, config.model.dtype, device, kernels_for(self.backend))
        self.timings = {"weights": time.perf_counter() - clock}
        clock = time.perf_counter()
        self.tokenizer = load_tokenizer(config, path)
        self.timings["tokenizer"] = time.perf_counter() - clock
        clock = time.perf_counter()
        self.model_path = path
        dims = self.model.dims
        self.max_model_len = config.model.max_model_len or dims.max_positions
        if self.max_model_len > dims.max_positions:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{dims.max_positions}"
            )
        self.runner = ModelRunner(self.model, config, self.max_model_len, self.backend)
        self.timings["KV cache"] = time.perf_counter() - clock
        num_blocks = kv_cache_blocks(config, self.runner, self.max_model_len, self.timings)
        clock = time.perf_counter()
        self.runner.allocate_kv(num_blocks)
        self.block_manager = BlockManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.eos_token_ids = self._eos_ids(path)
        self.parents: dict[str, Parent] = {}
        self.timings["KV cache"] += time.perf_counter() - clock
        log.info(
            "engine ready: %s (%s), %d KV blocks of %d tokens, max_model_len %d; kernels %s, attention %s, "
            "sampler %s",
            self.model.spec.name,
            self.model.embed.weight.dtype,
            num_blocks,
            config.cache.block_size,
            self.max_model_len,
            self.backend.kernels,
            self.backend.attention,
            self.backend.sampler,
        )

    def warmup(self, progress: bool = False) -> list[BucketReport]:
        """Builds every graph before the first request, through the compile cache: a complete entry is
        loaded first, so Inductor finds each graph instead of compiling it; a missing or corrupt one is
        (re)built and saved. The per-key lock makes concurrent warmups of one key take turns."""
        clock = time.perf_counter()
        cuda = self.runner.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(self.runner.device) / 2**30 if cuda else 0.0
        compile_config = self.config.compile
        options = {
            "mode": self.runner.lowering.mode,
            "backend": [self.backend.kernels, self.backend.attention],
            "decode_sizes": self.runner.lowering.plan.decode_sizes,
            "token_sizes": self.runner.lowering.plan.token_sizes,
        }
        cache = CompileCache(key_parts(self.model, self.runner.dtype, self.runner.device, options))
        if compile_config.cache_file is not None:
            cache.import_file(Path(compile_config.cache_file))
        with cache.lock():
            loaded = cache.load()
            reports = self.runner.lowering.warmup(self.runner.warm_step, progress)
            sampler_clock = time.perf_counter()
            self.runner.warm_sampler()
            sampler = time.perf_counter() - sampler_clock
            if not loaded and any(r.source != "shared" for r in reports):
                cache.save([r.as_dict() for r in reports])
        self.compile_cache = cache
        graphs = self.runner.lowering.graphs
        capture = graphs.seconds if graphs is not None else 0.0
        self.timings["compile"] = time.perf_counter() - clock - capture - sampler
        if graphs is not None:
            self.timings["CUDA graph capture"] = capture
            log.info("CUDA graphs: %d captured in %.2f s, pool %.2f GiB", len(graphs.captured), capture,
                     torch.cuda.memory_reserved(self.runner.device) / 2**30 - reserved)  # fmt: skip
        self.timings["sampler"] = sampler
        return reports

    def _eos_ids(self, path: Path) -> set[int]:
        ids = {self.tokenizer.eos_token_id} - {None}
        if (path / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(path).eos_token_id
            ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
        return ids

    # -- admission ----------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(ids)
        return ids

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model.dims.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams can't check alone: limits that depend on the model."""
        vocab = self.model.dims.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {k}")
        bad = [t for t in params.logit_bias or {} if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {bad[:4]}")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Validates, then queues; raises ValueError (and queues nothing) for a bad prompt or params."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_params(params)
        ids = self.tokenize(prompt)
        children = []
        for i in range(params.n):
            p = (
                params
                if params.n == 1
                else msgspec.structs.replace(
                    params,
                    n=1,
                    seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
            )
            child_id = f"{request_id}-{i}" if params.n > 1 else request_id
            children.append(self._request(child_id, request_id, ids, p))
        self.parents[request_id] = Parent(request_id, prompt if isinstance(prompt, str) else None, children)
        for child in children:
            self.scheduler.add(child)

    def _request(self, request_id: str, parent_id: str, ids: list[int], p: SamplingParams) -> Request:
        banned = (
            []
            if p.min_tokens == 0
            else sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
        )
        generator = None
        if p.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(p.seed)
        return Request(
            request_id=request_id,
            parent_id=parent_id,
            params=p,
            token_ids=list(ids),
            num_prompt_tokens=len(ids),
            max_tokens=p.max_tokens or self.max_model_len - len(ids),
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens),
            generator=generator,
            min_tokens_banned=banned,
            logprobs=[] if p.logprobs is not None else None,
            prompt_logprobs=[None] if p.prompt_logprobs is not None else None,
        )

    def abort(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        for child in parent.children if parent else []:
            if not child.finished:
                self.scheduler.finish(child)
                child.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -----------------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step; the cumulative outputs of the requests it advanced. With final_only (vLLM's
        FINAL_ONLY output kind, for callers that don't stream) only finished requests' outputs are built."""
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        result = self.runner.execute(batch)
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            req.num_computed_tokens += n
            self.block_manager.cache_full_blocks(req)
        touched = self._update(result)
        return [self._output(p) for p in touched if not final_only or p.finished]

    def _update(self, result: StepResult) -> list[Parent]:
        for req, pl in result.prompt_logprobs.items():
            assert req.prompt_logprobs is not None
            ks = [req.params.prompt_logprobs or 0] * len(pl.ranks)
            del req.prompt_logprobs[pl.first_position + 1 :]  # a preempted request scores its prompt again
            req.prompt_logprobs += logprob_dicts(
                self.tokenizer, pl.ids.tolist(), pl.logprobs.tolist(), pl.ranks.tolist(), ks
            )
        out = result.output
        if out is None:
            return []
        tokens = out.token_ids.tolist()
        if out.logprobs is not None:
            ks = [r.params.logprobs or 0 for r in result.sampled]
            rows = logprob_dicts(
                self.tokenizer, out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist(), ks
            )
        touched: dict[str, Parent] = {}
        for i, (req, token) in enumerate(zip(result.sampled, tokens, strict=True)):
            req.token_ids.append(token)
            if req.logprobs is not None:
                req.logprobs.append(rows[i])
                req.cumulative_logprob += rows[i][token].logprob
            self._check_stop(req, token)
            touched[req.parent_id] = self.parents[req.parent_id]
        return list(touched.values())

    def _check_stop(self, req: Request, token: int) -> None:
        p = req.params
        reason: tuple[str, int | str | None] | None = None
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                reason = ("stop", None)
            elif token in p.stop_token_ids:
                reason = ("stop", token)
        # As vLLM: the text of a stop token is left out unless include_stop_str_in_output.
        if reason is None or p.include_stop_str_in_output:
            new_text = req.detokenizer.step([token])
            req.text += new_text
            if reason is None and p.stop and req.num_output_tokens >= p.min_tokens:
                hit = find_stop(req.text, len(new_text), p.stop)
                if hit is not None:
                    start, stop = hit
                    req.text = (
                        req.text[: start + len(stop)] if p.include_stop_str_in_output else req.text[:start]
                    )
                    reason = ("stop", stop)
        if reason is None and (
            req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len
        ):
            reason = ("length", None)
        if reason is not None:
            req.finish_reason, req.stop_reason = reason
            self.scheduler.finish(req)

    def _output(self, parent: Parent) -> RequestOutput:
        out = parent.output()
        if out.finished:
            del self.parents[parent.request_id]
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.block_manager.usage,
            "prefix_cache_queries": self.block_manager.prefix_queries,
            "prefix_cache_hits": self.block_manager.prefix_hits,
            "preemptions": self.scheduler.num_preemptions,
        }
