"""Paged attention on the CPU through kiln's C++ kernel: one opaque op for every step, decode or mixed.

Each query row walks its own context in KV-cache blocks from position 0 with an online softmax, so its
result depends on its context alone: never on the rows beside it, on where chunked prefill split its
prompt, or on whether its prefix came from the prefix cache (fresh K/V are read back from the cache).

The cache tensor has the usual shape, [num_blocks + 1, 2, block_size, KVH, D], but the kernel's layout
inside each block: K transposed per kv head, [KVH, D, block_size], so a query's scores for a row of keys
come from the GEMM micro-kernel's FMA pattern (keys along vector lanes), then V per kv head,
[KVH, block_size, D]. With pairs (a bfloat16 or fp8 cache, an even D and kernels built with AVX512-BF16), K is
[KVH, D/2, block_size, 2], pairs of d side by side, and V is [KVH, block_size/2, D, 2], pairs of keys side
by side, for one dot-product instruction per pair. Only this module writes it and only the kernel reads it."""

import torch

from kiln.ops.attention import AttnMetadata, StepLayout
from kiln.ops.cpu import native

PAIRED = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)  # fp8 is widened to bfloat16 pairs


def pair_layout(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a cache of this dtype keeps K in pairs of d and V in pairs of keys (chosen once, and passed
    to the kernel)."""
    return dtype in PAIRED and head_dim % 2 == 0 and native.bf16_dot()


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, pairs: bool
) -> None:
    """k, v [T, KVH, D] into their slots, in the layout above, by kiln's C++ writer: tokens in parallel, in
    place. Padding slots (-1) are not written. (Inductor's scatter ran on one thread and cost 8% of a
    2,048-token prefill.)"""
    torch.ops.kiln_cpu.write_kv(k, v, kv_cache, slot_mapping, pairs)


def from_standard(cache: torch.Tensor, pairs: bool) -> torch.Tensor:
    """A cache in the usual layout (K and V as [block_size, KVH, D] per block) rewritten in the kernel's."""
    n, _, bs, kvh, dim = cache.shape
    if pairs:  # K as [n, KVH, D/2, bs, 2] memory, V as [n, KVH, bs/2, D, 2]
        k = cache[:, 0].reshape(n, bs, kvh, dim // 2, 2).permute(0, 2, 3, 1, 4).reshape(n, bs, kvh, dim)
        v = cache[:, 1].reshape(n, bs // 2, 2, kvh, dim).permute(0, 3, 1, 4, 2).reshape(n, bs, kvh, dim)
    else:  # K as [n, KVH, D, bs] memory, V as [n, KVH, bs, D]
        k = cache[:, 0].permute(0, 2, 3, 1).reshape(n, bs, kvh, dim)
        v = cache[:, 1].permute(0, 2, 1, 3).reshape(n, bs, kvh, dim)
    return torch.stack([k, v], dim=1)


class CpuAttention:
    graph_id = 0
    own_decode_graph = False
    reads_block_table = True

    def __init__(self, pairs: bool) -> None:
        self.pairs = pairs  # pair_layout(the cache's dtype, head_dim)

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
        write_kv(k, v, kv_cache, meta.slot_mapping, self.pairs)
        return torch.ops.kiln_cpu.paged_attention(
            q,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            scale,
            sliding_window,
            self.pairs,
        )
