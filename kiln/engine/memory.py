"""How big the KV cache is: cache.kv_cache_gib where set; on a GPU otherwise as vLLM sizes it, what the
weights, the peak of the largest step, the CUDA-graph pool, the penalties' rows and everything outside torch
leave of gpu_memory_utilization x the device's memory; on a CPU otherwise 1 GiB. cache.num_gpu_blocks_override
wins over all of them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.compile.buckets import Bucket
from kiln.config import EngineConfig
from kiln.engine.dummy_steps import DummySteps
from kiln.engine.runner import ModelRunner
from kiln.engine.token_counts import TokenCounts
from kiln.models.decoder import DecoderModel

log = logging.getLogger(__name__)

GIB = 2**30
CPU_KV_CACHE_GIB = 1.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's


def kv_block_bytes(model: DecoderModel, block_size: int, dtype: torch.dtype) -> int:
    d = model.dims
    return d.num_layers * 2 * block_size * d.num_kv_heads * d.head_dim * dtype.itemsize


@dataclass(slots=True)
class MemoryProfile:
    total: int  # the device's memory
    budget: int  # gpu_memory_utilization x total
    weights: int
    in_use: int  # everything allocated between steps: weights, workspaces, the CUDA context, other processes
    step_peak: int  # a max_num_batched_tokens step and the sampler's largest draw, above what is allocated
    graph_pool: int  # the CUDA graphs: the largest decode step's activations and inputs, every graph's output
    penalty_rows: int  # TokenCounts' rows, made at the first request with a penalty

    @property
    def kv_bytes(self) -> int:
        return self.budget - self.in_use - self.step_peak - self.graph_pool - self.penalty_rows

    def describe(self) -> str:
        return ", ".join(
            f"{name} {value / GIB:.2f} GiB"
            for name, value in (
                ("device", self.total),
                ("budget", self.budget),
                ("weights", self.weights),
                ("in use besides weights", self.in_use - self.weights),
                ("step peak", self.step_peak),
                ("CUDA graphs", self.graph_pool),
                ("penalty rows", self.penalty_rows),
                ("KV cache", self.kv_bytes),
            )
        )


def _peak_of(run: Callable[[], None], device: torch.device) -> int:
    """Bytes the call allocates above what was allocated before it, at its peak."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def profile_memory(runner: ModelRunner, utilization: float, max_tokens: int, graphs: bool) -> MemoryProfile:
    """Runs the largest mixed step and the largest sampler draw eagerly on a one-block KV cache (every slot
    is padding), then measures. The profile cache is freed before the real one is allocated."""
    device = runner.device
    dummy = DummySteps(runner)
    runner.allocate_kv(1)
    step = _peak_of(lambda: dummy.profile_step(Bucket("tokens", max_tokens)), device)
    sampler = _peak_of(lambda: dummy.profile_sampler(runner.max_num_seqs), device)
    itemsize = (runner.model.kernels.activations or runner.dtype).itemsize
    hidden = max_tokens * runner.model.dims.hidden_size * itemsize  # the step's output, held while it samples
    sizes = runner.lowering.plan.decode_sizes
    largest = Bucket("decode", sizes[-1])  # the largest CUDA graph, captured first
    # The graphs share one pool. Each later one reuses what the ones before it freed, but every graph keeps
    # its output (the step's hidden states) allocated there, for its replays to write. Outside the pool, they
    # share one copy of the largest step's inputs (CudaGraphs._static): per row, a full-width block table
    # where the attention reads it.
    outputs = sum(sizes[:-1]) * runner.model.dims.hidden_size * itemsize
    b = runner.buf
    per_row = (b.input_ids, b.positions, b.slot_mapping, b.query_start_loc, b.seq_lens)
    table = (b.block_table if runner.no_table is None else runner.no_table)[0].nbytes
    inputs = sizes[-1] * (table + sum(a.itemsize for a in per_row))
    pool = _peak_of(lambda: dummy.profile_step(largest), device) + outputs + inputs if graphs else 0
    runner.kv_caches = []
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    rows = TokenCounts.nbytes(runner.model.dims.vocab_size, runner.max_num_seqs)
    profile = MemoryProfile(
        total, int(utilization * total), weights, total - free, max(step, hidden + sampler), pool, rows
    )
    log.info("GPU memory: %s", profile.describe())
    return profile


def kv_cache_blocks(
    config: EngineConfig, runner: ModelRunner, max_model_len: int, timings: dict[str, float]
) -> int:
    """The number of KV blocks the block manager hands out (the runner allocates one more, for padding)."""
    c = config.cache
    block_bytes = kv_block_bytes(runner.model, c.block_size, runner.kv_dtype)
    if c.kv_cache_gib is not None or runner.device.type != "cuda":
        if c.gpu_memory_utilization is not None:
            why = "cache.kv_cache_gib is set" if c.kv_cache_gib is not None else "the device is not a GPU"
            log.warning("cache.gpu_memory_utilization is not used: %s", why)
        gib = c.kv_cache_gib if c.kv_cache_gib is not None else CPU_KV_CACHE_GIB
        source = f"cache.kv_cache_gib={gib}"
        kv_bytes = int(gib * GIB)
    else:
        clock = time.perf_counter()
        utilization = c.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        graphs = runner.lowering.graphs is not None
        kv_bytes = profile_memory(
            runner, utilization, config.scheduler.max_num_batched_tokens, graphs
        ).kv_bytes
        source = f"cache.gpu_memory_utilization={utilization}"
        timings["memory profile"] = time.perf_counter() - clock
    num_blocks = kv_bytes // block_bytes - 1  # one is the padding block
    if (override := c.num_gpu_blocks_override) is not None:
        log.info("overriding %d KV blocks with cache.num_gpu_blocks_override=%d", num_blocks, override)
        num_blocks, source = override, f"cache.num_gpu_blocks_override={override}"
    if num_blocks * c.block_size < max_model_len:
        raise ValueError(
            f"{source} leaves a KV cache of {max(0, num_blocks) * c.block_size} tokens, fewer than "
            f"max_model_len={max_model_len}; give the cache more memory or lower max_model_len"
        )
    return num_blocks
