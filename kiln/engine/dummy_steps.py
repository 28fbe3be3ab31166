"""Steps of no request: warmup runs one of each bucket and every sampling path, so nothing is built after
ready; the memory profile runs the largest of them eagerly, to size the KV cache from what is left."""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import numpy as np
import torch

from kiln.compile.buckets import Bucket
from kiln.compile.reports import BucketReport
from kiln.engine.runner import ModelRunner
from kiln.ops.sampler import Sampler
from kiln.ops.sampling_metadata import Penalties, SamplingMetadata
from kiln.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Triton builds a kernel apart for each kind of integer argument it specializes: 1, a multiple of 16, any
# other. A kernel taking a row count, run outside the graphs, is warmed at one of each.
TRITON_ROW_KINDS = (1, 2, 16)


class DummySteps:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def warmup(self, progress: bool, cache_file: Path | None) -> tuple[list[BucketReport], dict[str, float]]:
        """Builds every graph (the lowering's warmup, through the compile cache), then every sampling
        kernel; returns the per-bucket reports and the seconds of each part (compile, CUDA graph capture,
        sampler)."""
        runner, clock = self.runner, time.perf_counter()
        cuda = runner.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(runner.device) / 2**30 if cuda else 0.0
        reports = runner.lowering.warmup(
            self.warm_step, runner.block_size, runner.kv_dtype, progress, cache_file
        )
        graphs = runner.lowering.graphs
        capture = graphs.seconds if graphs is not None else 0.0
        timings = {"compile": time.perf_counter() - clock - capture}
        if graphs is not None:
            timings["CUDA graph capture"] = capture
            log.info("CUDA graphs: %d captured in %.2f s, pool %.2f GiB", len(graphs.captured), capture,
                     torch.cuda.memory_reserved(runner.device) / 2**30 - reserved)  # fmt: skip
        clock = time.perf_counter()
        self.warm_sampler()
        timings["sampler"] = time.perf_counter() - clock
        return reports, timings

    @torch.inference_mode()
    def warm_step(self, bucket: Bucket) -> None:
        """A step of the bucket's shape that writes nothing to the KV cache: every slot is padding and
        every context reads block 0. Decode buckets are one token per request; a mixed bucket is prefill
        chunks (each at most max_model_len) plus two decode rows, so it also builds the decode kernel mixed
        steps use."""
        size, n = self._fill(bucket)
        self.runner.forward(size, n, bucket.kind == "decode")

    @torch.inference_mode()
    def profile_step(self, bucket: Bucket) -> None:
        """warm_step's step run eagerly, outside the lowering (nothing compiled or captured)."""
        size, n = self._fill(bucket)
        _, args = self.runner.step_inputs(size, n, bucket.kind == "decode")
        with torch.compiler.set_stance("force_eager"):
            self.runner.model(*args)

    def _fill(self, bucket: Bucket) -> tuple[int, int]:
        runner, size = self.runner, bucket.size
        q_lens = [1] * size
        if bucket.kind == "tokens":
            decode_rows = max(0, min(2, runner.max_num_seqs - 1, size - 2))
            prefill = size - decode_rows
            chunk = min(prefill, runner.max_model_len)
            q_lens = [chunk] * (prefill // chunk) + [prefill % chunk] * (prefill % chunk > 0)
            q_lens = q_lens[: runner.max_num_seqs - decode_rows] + [1] * decode_rows
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        n, size, buf = len(q_lens), int(cu[-1]), runner.buf
        buf.input_ids[:size] = 0
        buf.positions[:size] = 0
        buf.slot_mapping[:size] = -1
        buf.lora_slots[:size] = -1
        buf.query_start_loc[: n + 1] = cu
        buf.seq_lens[:n] = q_lens
        buf.fill_blocks(slice(0, n), 0)
        return size, n

    @torch.inference_mode()
    def profile_sampler(self, rows: int) -> None:
        """The sampler's largest step: every row with every filter and penalty, on full-vocabulary logits."""
        device, vocab = self.runner.device, self.runner.model.dims.vocab_size
        p = SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.01, repetition_penalty=1.1)
        empty: list[list[int]] = [[]] * rows
        penalties = Penalties.from_ids([p] * rows, [[0]] * rows, empty, vocab, device)
        meta = SamplingMetadata.build([p] * rows, [None] * rows, empty, vocab, device, penalties)
        self._throwaway_sampler()(torch.zeros(rows, vocab, device=device), meta)

    def _throwaway_sampler(self) -> Sampler:
        """The engine's sampler on its own generator: the engine's stream of draws is left as it was."""
        s, generator = self.runner.sampler, torch.Generator(device=self.runner.device).manual_seed(0)
        return Sampler(generator, s.prepare, s.draw, s.mask, s.argmax, s.logprobs_mode)

    @torch.inference_mode()
    def warm_sampler(self) -> None:
        """Draws once through every sampling path (each combination of penalties, bias and banned ids the
        prep kernel specializes on; plain, top-k/top-p, and top-p with min-p draws), so every kernel is
        built before serving. A step without a penalty passes none (TokenCounts.penalties), and Triton
        builds the kernel apart for each argument that is None: so do the warm rows. The LM head runs
        outside the graphs too: deterministic mode's is a Triton GEMM."""
        runner = self.runner
        model, device, vocab = runner.model, runner.device, runner.model.dims.vocab_size
        dtype = model.kernels.activations or runner.dtype
        hidden = torch.zeros(16, model.dims.hidden_size, dtype=dtype, device=device)
        for rows in TRITON_ROW_KINDS:
            model.compute_logits(hidden[:rows])
        throwaway = self._throwaway_sampler()
        for i, (penalty, bias, banned) in enumerate(itertools.product((False, True), repeat=3)):
            draw = i % 3  # 0: plain, 1: top-k/top-p, 2: top-p and min-p
            p = SamplingParams(
                temperature=1.0,
                top_k=5 if draw == 1 else -1,
                top_p=0.9 if draw else 1.0,
                min_p=0.01 if draw == 2 else 0.0,
                repetition_penalty=1.1 if penalty else 1.0,
                logit_bias={0: 1.0} if bias else None,
            )
            ban = [[1]] * 2 if banned else [[]] * 2
            penalties = Penalties.from_ids([p] * 2, [[0]] * 2, [[]] * 2, vocab, device) if penalty else None
            meta = SamplingMetadata.build([p] * 2, [None] * 2, ban, vocab, device, penalties)
            throwaway(torch.zeros(2, vocab, device=device), meta)
        if device.type == "cuda":
            # xgrammar's bitmask kernel is Triton, built on first use.
            allowed = torch.full((16, (vocab + 31) // 32), -1, dtype=torch.int32)
            logits = torch.zeros(16, vocab, device=device)
            for rows in TRITON_ROW_KINDS:
                runner.sampler.mask(logits, allowed, list(range(rows)))
