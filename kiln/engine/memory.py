"""Sizing the KV cache on a GPU as vLLM does: of gpu_memory_utilization x the device's memory, what the
weights, the peak of the largest step, the CUDA-graph pool and everything outside torch leave over."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.compile.buckets import Bucket
from kiln.engine.runner import ModelRunner

log = logging.getLogger(__name__)

GIB = 2**30


@dataclass(slots=True)
class MemoryProfile:
    total: int  # the device's memory
    budget: int  # gpu_memory_utilization x total
    weights: int
    in_use: int  # everything allocated between steps: weights, workspaces, the CUDA context, other processes
    step_peak: int  # a max_num_batched_tokens step and the sampler's largest draw, above what is allocated
    graph_pool: int  # the largest decode step's activations, which its CUDA graph keeps in its own pool

    @property
    def kv_bytes(self) -> int:
        return self.budget - self.in_use - self.step_peak - self.graph_pool

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
    runner.allocate_kv(1)
    step = _peak_of(lambda: runner.profile_step(Bucket("tokens", max_tokens)), device)
    sampler = _peak_of(lambda: runner.profile_sampler(runner.max_num_seqs), device)
    pool = (
        _peak_of(lambda: runner.profile_step(Bucket("decode", runner.max_num_seqs)), device) if graphs else 0
    )
    runner.kv_caches = []
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    profile = MemoryProfile(total, int(utilization * total), weights, total - free, max(step, sampler), pool)
    log.info("GPU memory: %s", profile.describe())
    return profile
