"""Builds each step's flat batch in persistent buffers, runs the model, and samples."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kiln.compile.buckets import Bucket, BucketPlan
from kiln.compile.buffers import StepBuffers
from kiln.compile.lowering import BucketReport, Lowering
from kiln.config import EngineConfig
from kiln.engine.grammar import Grammars
from kiln.engine.request import Request
from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.step_result import PromptLogprobs, StepResult
from kiln.engine.token_counts import TokenCounts
from kiln.models.decoder import DecoderModel
from kiln.ops.attention import AttnMetadata, StepLayout
from kiln.ops.backend import TORCH_BACKEND, Backend
from kiln.ops.sampler import Sampler, logprobs_in_chunks
from kiln.ops.sampling_metadata import Penalties, SamplingMetadata
from kiln.ops.transfer import to_device
from kiln.platform import keep_freed_memory
from kiln.sampling_params import SamplingParams

log = logging.getLogger(__name__)


# Triton builds a kernel apart for each kind of integer argument it specializes: 1, a multiple of 16, any
# other. A kernel taking a row count, run outside the graphs, is warmed at one of each.
TRITON_ROW_KINDS = (1, 2, 16)


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        config: EngineConfig,
        max_model_len: int,
        backend: Backend = TORCH_BACKEND,
        grammars: Grammars | None = None,
    ) -> None:
        """The model comes built with the backend's kernels and attention; the KV cache comes later
        (allocate_kv): on a GPU it is sized by profiling this runner's steps. grammars: where the
        constrained rows' token bitmasks come from."""
        self.model = model
        self.grammars = grammars
        self.device = model.embed.weight.device
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = model.embed.weight.dtype
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.kv_caches: list[torch.Tensor] = []
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.buf = StepBuffers(
            config.scheduler.max_num_batched_tokens, self.max_num_seqs, max_model_len, self.block_size
        )
        # FlashInfer plans from the host's table: its kernels never read a device copy, so a fixed stand-in
        # replaces one of every row's blocks each step (full width, in a CUDA graph).
        stand_in = torch.zeros((self.max_num_seqs + 1, 2), dtype=torch.int32, device=self.device)
        self.no_table = None if model.attention.reads_block_table else stand_in
        generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        self.sampler = Sampler(generator, *backend.sampler_ops())
        self.token_counts = TokenCounts(model.dims.vocab_size, self.device, self.max_num_seqs)
        # The last step's sampled tokens, on the device, and each sampled request's row in them: a request
        # whose token is still pending (async scheduling) reads it from there.
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.last_rows: dict[Request, int] = {}
        self.lowering = Lowering(model, config.compile.mode, BucketPlan.from_config(config), backend)

    def allocate_kv(self, num_blocks: int) -> None:
        """One block more than the block manager hands out: padding slots (-1) land there (see write_kv)."""
        d = self.model.dims
        self.kv_caches = []  # the old cache is freed before the new one is made
        shape = (num_blocks + 1, 2, self.block_size, d.num_kv_heads, d.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(d.num_layers)
        ]
        self.buf.padding_block = num_blocks

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, None, self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, land: Callable[[], None] | None = None) -> StepResult:
        """Launches the step's forward, then its sampling. land, when given, runs between the two: the
        engine lands the last step's tokens there, which this step's grammar bitmasks need, while the
        device runs the forward."""
        reqs, new = batch.requests, batch.num_new_tokens
        num_reqs = len(reqs)
        # Python ints for the loop over requests (a numpy scalar costs several times more per operation).
        starts = [r.num_computed_tokens for r in reqs]
        cu = list(itertools.accumulate(new, initial=0))
        num_tokens = cu[-1]

        # Per request, not per token: copy its new tokens and its new block ids. A pending token is the last
        # of its request's new tokens; the device fills it in from the last step's samples.
        buf = self.buf
        pending: list[tuple[int, int]] = []  # (its position in the flat batch, its row in last_tokens)
        for i, r in enumerate(reqs):
            start, end = starts[i], starts[i] + new[i]
            known = min(end, r.num_tokens)
            if known > start:
                buf.input_ids[cu[i] : cu[i] + known - start] = r.token_ids[start:known]
            if known < end:
                pending.append((cu[i + 1] - 1, self.last_rows[r]))
            buf.set_blocks(i, r.block_ids)
        num_new, cu_np = np.asarray(new, dtype=np.int64), np.asarray(cu, dtype=np.int64)
        starts_np = np.asarray(starts, dtype=np.int64)
        req_of_token = np.repeat(np.arange(num_reqs), num_new)
        positions = np.arange(num_tokens) - cu_np[req_of_token] + starts_np[req_of_token]
        buf.positions[:num_tokens] = positions
        buf.slot_mapping[:num_tokens] = (
            buf.block_table[req_of_token, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        buf.query_start_loc[: num_reqs + 1] = cu_np
        buf.seq_lens[:num_reqs] = starts_np + num_new
        hidden = self._forward(num_tokens, num_reqs, bool((num_new == 1).all()), pending)
        if land is not None:
            land()

        sampling = [i for i, r in enumerate(reqs) if starts[i] + new[i] == r.num_tokens + r.num_pending]
        prompt_logprobs = self._prompt_logprobs(reqs, starts, new, cu, hidden)
        if not sampling:
            self.last_rows = {}
            return StepResult.launched([], None, prompt_logprobs)
        sampled = [reqs[i] for i in sampling]
        allowed = self._allowed(sampled)  # on the CPU, while a GPU runs the forward
        banned = [r.banned_ids for r in sampled]
        if allowed is not None:
            assert self.grammars is not None
            self.grammars.keep_ends(*allowed, banned)
        logits = self.model.compute_logits(hidden[self._tensor(cu_np[1:][sampling] - 1)])
        meta = SamplingMetadata.build(
            [r.params for r in sampled],
            [r.generator for r in sampled],
            banned,
            logits.shape[-1],
            self.device,
            self.token_counts.penalties(sampled),
            allowed,
        )
        out = self.sampler(logits, meta)
        self.token_counts.update(out.token_ids)
        self.last_tokens, self.last_rows = out.token_ids, {r: j for j, r in enumerate(sampled)}
        return StepResult.launched(sampled, out, prompt_logprobs, constrained=allowed is not None)

    def _allowed(self, sampled: list[Request]) -> tuple[torch.Tensor, list[int]] | None:
        """The token bitmask of the rows under a grammar, and which rows those are."""
        rows, grammars = [], []
        for i, r in enumerate(sampled):
            if r.grammar is not None and r.grammar.active:
                rows.append(i)
                grammars.append(r.grammar)
        if not rows:
            return None
        assert self.grammars is not None
        return self.grammars.bitmask(grammars, rows, len(sampled)), rows

    def _forward(
        self, num_tokens: int, num_reqs: int, decode_only: bool, pending: list[tuple[int, int]] | None = None
    ) -> torch.Tensor:
        """Runs the model on the first num_tokens/num_reqs entries of the staging buffers; `pending`
        input ids are taken from the last step's samples on the device."""
        num_tokens, args = self.step_inputs(num_tokens, num_reqs, decode_only)
        if pending:
            at, rows = self._tensor(np.array(pending, dtype=np.int64)).T
            args[0][at] = self.last_tokens[rows]
        return self.lowering(num_tokens, decode_only, *args)

    def step_inputs(self, num_tokens: int, num_reqs: int, decode_only: bool) -> tuple[int, tuple]:
        """Pads the step (the lowering's shapes), plans the attention backend and returns the model's
        arguments (and the padded token count)."""
        buf = self.buf
        step = self.lowering.pad(buf, num_tokens, num_reqs, decode_only)
        num_tokens, num_reqs = step.num_tokens, step.num_reqs
        layout = StepLayout(
            buf.query_start_loc[: num_reqs + 1],
            buf.seq_lens[:num_reqs],
            buf.block_table[:num_reqs, : step.width],
            decode_only,
            step.graph,
        )
        self.model.attention.plan(layout)
        table = self._tensor(layout.block_table) if self.no_table is None else self.no_table[:num_reqs]
        meta = AttnMetadata(
            self._tensor(buf.slot_mapping[:num_tokens]), self._tensor(layout.query_start_loc),
            self._tensor(layout.seq_lens), table, decode_only,
        )  # fmt: skip
        ids, positions = self._tensor(buf.input_ids[:num_tokens]), self._tensor(buf.positions[:num_tokens])
        return num_tokens, (ids, positions, self.kv_caches, meta)

    def warmup(self, progress: bool, cache_file: Path | None) -> tuple[list[BucketReport], float]:
        """Builds every graph (the lowering's warmup, through the compile cache), then every sampling
        kernel; returns the per-bucket reports and the sampler's seconds."""
        reports = self.lowering.warmup(self.warm_step, self.block_size, progress, cache_file)
        clock = time.perf_counter()
        self.warm_sampler()
        return reports, time.perf_counter() - clock

    @torch.inference_mode()
    def warm_step(self, bucket: Bucket) -> None:
        """A step of the bucket's shape that writes nothing to the KV cache: every slot is padding and
        every context reads block 0. Decode buckets are one token per request; a mixed bucket is prefill
        chunks (each at most max_model_len) plus two decode rows, so it also builds the decode kernel mixed
        steps use."""
        size, n = self._fill_warm_step(bucket)
        self._forward(size, n, bucket.kind == "decode")

    def _fill_warm_step(self, bucket: Bucket) -> tuple[int, int]:
        size = bucket.size
        q_lens = [1] * size
        if bucket.kind == "tokens":
            decode_rows = max(0, min(2, self.max_num_seqs - 1, size - 2))
            prefill = size - decode_rows
            chunk = min(prefill, self.max_model_len)
            q_lens = [chunk] * (prefill // chunk) + [prefill % chunk] * (prefill % chunk > 0)
            q_lens = q_lens[: self.max_num_seqs - decode_rows] + [1] * decode_rows
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        n, size, buf = len(q_lens), int(cu[-1]), self.buf
        buf.input_ids[:size] = 0
        buf.positions[:size] = 0
        buf.slot_mapping[:size] = -1
        buf.query_start_loc[: n + 1] = cu
        buf.seq_lens[:n] = q_lens
        buf.fill_blocks(slice(0, n), 0)
        return size, n

    @torch.inference_mode()
    def profile_step(self, bucket: Bucket) -> None:
        """warm_step's step run eagerly, outside the lowering (nothing compiled or captured)."""
        size, n = self._fill_warm_step(bucket)
        _, args = self.step_inputs(size, n, bucket.kind == "decode")
        with torch.compiler.set_stance("force_eager"):
            self.model(*args)

    @torch.inference_mode()
    def profile_sampler(self, rows: int) -> None:
        """The sampler's largest step: every row with every filter and penalty, on full-vocabulary logits."""
        vocab = self.model.dims.vocab_size
        p = SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.01, repetition_penalty=1.1)
        empty: list[list[int]] = [[]] * rows
        penalties = Penalties.from_ids([p] * rows, [[0]] * rows, empty, vocab, self.device)
        meta = SamplingMetadata.build([p] * rows, [None] * rows, empty, vocab, self.device, penalties)
        self._throwaway_sampler()(torch.zeros(rows, vocab, device=self.device), meta)

    def _throwaway_sampler(self) -> Sampler:
        """The engine's sampler on its own generator: the engine's stream of draws is left as it was."""
        s, generator = self.sampler, torch.Generator(device=self.device).manual_seed(0)
        return Sampler(generator, s.prepare, s.draw, s.mask, s.argmax)

    @torch.inference_mode()
    def warm_sampler(self) -> None:
        """Draws once through every sampling path (each combination of penalties, bias and banned ids the
        prep kernel specializes on; plain, top-k/top-p and min-p draws), so every kernel is built before
        serving. A step without a penalty passes none (TokenCounts.penalties), and Triton builds the kernel
        apart for each argument that is None: so do the warm rows. The LM head runs outside the graphs too:
        deterministic mode's is a Triton GEMM."""
        vocab = self.model.dims.vocab_size
        dtype = self.model.kernels.activations or self.dtype
        hidden = torch.zeros(16, self.model.dims.hidden_size, dtype=dtype, device=self.device)
        for rows in TRITON_ROW_KINDS:
            self.model.compute_logits(hidden[:rows])
        throwaway = self._throwaway_sampler()
        for i, (penalty, bias, banned) in enumerate(itertools.product((False, True), repeat=3)):
            draw = i % 3  # 0: plain, 1: top-k/top-p, 2: and min-p
            p = SamplingParams(
                temperature=1.0,
                top_k=5 if draw else -1,
                top_p=0.9 if draw else 1.0,
                min_p=0.01 if draw == 2 else 0.0,
                repetition_penalty=1.1 if penalty else 1.0,
                logit_bias={0: 1.0} if bias else None,
            )
            ban = [[1]] * 2 if banned else [[]] * 2
            penalties = (
                Penalties.from_ids([p] * 2, [[0]] * 2, [[]] * 2, vocab, self.device) if penalty else None
            )
            meta = SamplingMetadata.build([p] * 2, [None] * 2, ban, vocab, self.device, penalties)
            throwaway(torch.zeros(2, vocab, device=self.device), meta)
        if self.device.type == "cuda":
            # xgrammar's bitmask kernel is Triton, built on first use.
            allowed = torch.full((16, (vocab + 31) // 32), -1, dtype=torch.int32)
            logits = torch.zeros(16, vocab, device=self.device)
            for rows in TRITON_ROW_KINDS:
                self.sampler.mask(logits, allowed, list(range(rows)))

    def _prompt_logprobs(
        self, reqs: list[Request], starts: list[int], new: list[int], cu: list[int], hidden: torch.Tensor
    ) -> dict[Request, PromptLogprobs]:
        out = {}
        for i, r in enumerate(reqs):
            k = r.params.prompt_logprobs
            if k is None:
                continue
            start = starts[i]
            # Rows whose next token is still a prompt token.
            end = min(start + new[i], r.num_prompt_tokens - 1)
            if end <= start:
                continue
            targets = to_device(r.token_ids[start + 1 : end + 1], torch.int64, self.device)
            rows = hidden[cu[i] : cu[i] + end - start]
            logprobs = logprobs_in_chunks(self.model.compute_logits, rows, targets, k, self.max_num_seqs)
            out[r] = PromptLogprobs(start, *logprobs)
        return out
