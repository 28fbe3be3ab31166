"""Builds each step's flat batch in persistent buffers, runs the model, and samples."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import numpy as np
import torch

from kiln.compile.buckets import BucketPlan
from kiln.compile.buffers import StepBuffers
from kiln.compile.lowering import Lowering
from kiln.config import EngineConfig
from kiln.engine.grammar import Grammars
from kiln.engine.lora_slots import LoraSlots
from kiln.engine.request import Request
from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.speculative import check_drafts, draft_rows, drafts_ahead
from kiln.engine.step_result import PromptLogprobs, StepResult
from kiln.engine.token_counts import TokenCounts
from kiln.models.decoder import DecoderModel, GivenEmbeds
from kiln.ops.attention import AttnMetadata, StepLayout
from kiln.ops.backend import TORCH_BACKEND, Backend
from kiln.ops.logprobs import logprobs_in_chunks
from kiln.ops.sampler import Sampler
from kiln.ops.sampling_metadata import SamplingMetadata
from kiln.ops.transfer import to_device
from kiln.platform import keep_freed_memory

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        config: EngineConfig,
        max_model_len: int,
        backend: Backend = TORCH_BACKEND,
        grammars: Grammars | None = None,
        pools: bool = False,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """The model comes built with the backend's kernels and attention; the KV cache comes later
        (allocate_kv): on a GPU it is sized by profiling this runner's steps. grammars: where the
        constrained rows' token bitmasks come from. pools: its requests are for embeddings (runner
        pooling), made from the hidden states; nothing is sampled. kv_dtype: what the cache stores
        (None: the model's dtype); the attention was made for it."""
        self.model = model
        self.pools = pools
        self.grammars = grammars
        self.device = model.embed.weight.device
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = model.embed.weight.dtype
        self.kv_dtype = kv_dtype or self.dtype
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
        self.sampler = Sampler(generator, *backend.sampler_ops(), logprobs_mode=config.model.logprobs_mode)
        self.token_counts = TokenCounts(model.dims.vocab_size, self.device, self.max_num_seqs)
        # The last step's sampled tokens, on the device, and each sampled request's row in them: a request
        # whose token is still pending (async scheduling) reads it from there.
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.last_rows: dict[Request, int] = {}
        self.lowering = Lowering(model, config.compile.mode, BucketPlan.from_config(config), backend)
        self.loras = None if model.lora is None else LoraSlots(model, config.lora.max_cpu_loras)

    def allocate_kv(self, num_blocks: int) -> None:
        """One block more than the block manager hands out: padding slots (-1) land there (see write_kv)."""
        d = self.model.dims
        self.kv_caches = []  # the old cache is freed before the new one is made
        shape = (num_blocks + 1, 2, self.block_size, d.num_kv_heads, d.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(d.num_layers)
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
        embedded: list[tuple[int, torch.Tensor]] = []  # (first position, rows) of prompts given as embeddings
        spec = batch.drafts
        for i, r in enumerate(reqs):
            start, end = starts[i], starts[i] + new[i]
            if r.prompt_embeds is not None and start < r.num_prompt_tokens:
                embedded.append((cu[i], r.prompt_embeds[start : min(end, r.num_prompt_tokens)]))
            if spec and (drafts := spec.get(r)):  # they follow its last token
                end -= len(drafts)
                buf.input_ids[cu[i + 1] - len(drafts) : cu[i + 1]] = drafts
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
        if self.loras is not None:
            buf.lora_slots[:num_tokens] = np.repeat(self.loras.assign([r.lora for r in reqs]), num_new)
        given = self._given(embedded) if embedded else None
        # A captured CUDA graph looks every row up by id: with CUDA graphs, a step with given rows runs as a
        # mixed step (elsewhere the lookup is eager, ahead of the compiled layers, in either kind of step).
        decode_only = bool((num_new == 1).all()) and (given is None or self.lowering.graphs is None)
        hidden = self.forward(num_tokens, num_reqs, decode_only, pending, given)
        if land is not None:
            land()

        if self.pools:
            return StepResult.launched([], None, {}, pooled=self._pooled(reqs, starts, cu, hidden))
        ends = [r.num_tokens + r.num_pending + len(spec.get(r, ())) for r in reqs] if spec else None
        sampling = [
            i
            for i, r in enumerate(reqs)
            if starts[i] + new[i] == (r.num_tokens + r.num_pending if ends is None else ends[i])
        ]
        prompt_logprobs = self._prompt_logprobs(reqs, starts, new, cu, hidden)
        if not sampling:
            self.last_rows = {}
            return StepResult.launched([], None, prompt_logprobs)
        sampled = [reqs[i] for i in sampling]
        # One row a sampled request, and with drafts one more a draft: row j scores the token after its
        # j-th draft.
        rows = cu_np[1:][sampling] - 1
        drafts, ahead, row_reqs = None, None, sampled
        if spec:
            drafts = [spec.get(r, []) for r in sampled]
            rows, ahead = draft_rows(rows, drafts), drafts_ahead(sampled, drafts)
            row_reqs = [r for r, d in zip(sampled, drafts, strict=True) for _ in range(1 + len(d))]
        allowed = self._allowed(row_reqs)  # on the CPU, while a GPU runs the forward
        banned = [r.banned_ids for r in row_reqs]
        forced = {
            i: token
            for i, r in enumerate(row_reqs)
            if r.thinking is not None and (token := r.thinking.forced()) is not None
        }
        if allowed is not None:
            assert self.grammars is not None
            self.grammars.keep_ends(*allowed, banned)
        logits = self.model.compute_logits(hidden[self._tensor(rows)])
        meta = SamplingMetadata.build(
            [r.params for r in row_reqs],
            [r.generator for r in row_reqs],
            banned,
            logits.shape[-1],
            self.device,
            self.token_counts.penalties(row_reqs, ahead),
            allowed,
            forced,
        )
        out = self.sampler(logits, meta)
        spans = None if drafts is None else check_drafts(out.token_ids, drafts)
        self.token_counts.update(out.token_ids, None if spans is None else spans.kept_rows)
        # (Drafts run synchronously: no pending token is read from these rows then.)
        self.last_tokens, self.last_rows = out.token_ids, {r: j for j, r in enumerate(sampled)}
        return StepResult.launched(
            sampled, out, prompt_logprobs, any(r.reads_output for r in sampled), spans=spans
        )

    def _pooled(
        self, reqs: list[Request], starts: list[int], cu: list[int], hidden: torch.Tensor
    ) -> dict[Request, torch.Tensor]:
        """The embeddings of the requests whose prompts this step ended."""
        out = {}
        for i, r in enumerate(reqs):
            assert r.pooling is not None
            v = r.pooling.take(hidden[cu[i] : cu[i + 1]], starts[i], r.num_prompt_tokens)
            if v is not None:
                out[r] = v
        return out

    def _allowed(self, sampled: list[Request]) -> tuple[torch.Tensor, list[int]] | None:
        """The token bitmask of the rows under a grammar, and which rows those are."""
        rows, grammars, openers = [], [], []
        for i, r in enumerate(sampled):
            if r.grammar is not None and r.constrained:
                rows.append(i)
                grammars.append(r.grammar)
                if r.thinking is not None and r.thinking.opener is not None:
                    openers.append((i, r.thinking.opener))
        if not rows:
            return None
        assert self.grammars is not None
        return self.grammars.bitmask(grammars, rows, len(sampled), openers), rows

    def forward(
        self,
        num_tokens: int,
        num_reqs: int,
        decode_only: bool,
        pending: list[tuple[int, int]] | None = None,
        given: GivenEmbeds | None = None,
    ) -> torch.Tensor:
        """Runs the model on the first num_tokens/num_reqs entries of the staging buffers; `pending`
        input ids are taken from the last step's samples on the device; `given` rows' embeddings replace
        their ids'."""
        num_tokens, args = self.step_inputs(num_tokens, num_reqs, decode_only)
        if pending:
            at, rows = self._tensor(np.array(pending, dtype=np.int64)).T
            args[0][at] = self.last_tokens[rows]
        if given is not None:
            args = (*args, given)
        return self.lowering(num_tokens, decode_only, *args)

    def _given(self, embedded: list[tuple[int, torch.Tensor]]) -> GivenEmbeds:
        rows = np.concatenate([np.arange(at, at + len(values)) for at, values in embedded])
        values = torch.cat([values for _, values in embedded])
        return GivenEmbeds(self._tensor(rows), to_device(values, None, self.device))

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
        lora = None if self.loras is None else self._tensor(buf.lora_slots[:num_tokens])
        return num_tokens, (ids, positions, self.kv_caches, meta, lora)

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
            logprobs = logprobs_in_chunks(
                self.model.compute_logits, rows, targets, k, self.max_num_seqs, self.sampler.as_logits
            )
            out[r] = PromptLogprobs(start, *logprobs)
        return out
