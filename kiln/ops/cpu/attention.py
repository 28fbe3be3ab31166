"""Paged attention on the CPU through kiln's C++ kernel: one opaque op for every step, decode or mixed.

Each query row walks its own context in KV-cache blocks from position 0 with an online softmax, so its
result depends on its context alone: never on the rows beside it, on where chunked prefill split its
prompt, or on whether its prefix came from the prefix cache (fresh K/V are read back from the cache)."""

import torch

from kiln.ops.attention import AttnMetadata, StepLayout, write_kv


class CpuAttention:
    def plan(self, layout: StepLayout) -> None:
        pass

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttnMetadata,
        scale: float,
        sliding_window: int,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return torch.ops.kiln_cpu.paged_attention(
            q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, scale, sliding_window
        )


CPU_ATTENTION = CpuAttention()
