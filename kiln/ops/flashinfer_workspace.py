"""How large FlashInfer's float workspace must be: its split-KV scratch, which a plan carves out of it and
which FlashInfer refuses to outgrow ("Buffer overflow ... Increase the workspace buffer size").

Read from FlashInfer 0.5.3's scheduler.cuh. FA2's planner (PrefillPlan: prefill off Hopper, and decode
with tensor cores everywhere) takes num_qo_heads x padded_batch x cta_tile_q x (head_dim + 1) floats (tmp_v
and tmp_s). Outside CUDA graphs it splits only when the split's tiles fit 2 CTAs per SM per KV head. A
CUDA-graph plan always splits, padded to an upper bound of its query tiles, so it grows with the graph's
batch: Qwen3-32B's shape (64 query heads over 8) at batch 512 needs 405 MB. FA3 (Hopper's prefill) and
CUDA-core decode take little of it (the floor covers them)."""

from __future__ import annotations

FLOOR_BYTES = 256 * 2**20
CTAS_PER_SM = 2  # PrefillPlan's num_blocks_per_sm
SLACK_BYTES = 2**20  # the planner aligns each of its buffers to 16 bytes


def fa2_cta_tile_q(packed_qo_len: int, head_dim: int) -> int:
    """FA2DetermineCtaTileQ (utils.cuh) on Ampere or newer: the query tile, in packed rows (tokens x heads
    per KV head)."""
    if packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if packed_qo_len > 16 else 16


def _scratch(num_heads: int, tiles: int, cta_tile_q: int, head_dim: int) -> int:
    return num_heads * tiles * cta_tile_q * (head_dim + 1) * 4


def graph_decode_scratch(num_heads: int, num_kv_heads: int, head_dim: int, num_sms: int, batch: int) -> int:
    """A tensor-core decode CUDA graph's plan at this batch: one query row packs its group of heads."""
    group = num_heads // num_kv_heads
    cta = fa2_cta_tile_q(group, head_dim)
    tiles = max(CTAS_PER_SM * num_sms // num_kv_heads, -(-batch * group // cta) + batch - 1)
    return _scratch(num_heads, tiles, cta, head_dim)


def workspace_bytes(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_sms: int,
    max_graph_batch: int,
    tensor_cores: bool,
    fa2_prefill: bool,
) -> int:
    """The float workspace every wrapper shares: the largest plan kiln makes, or FLOOR_BYTES."""
    need = 0
    if fa2_prefill:  # split at most into the CTAs of the GPU, with the largest query tile
        split_batch = CTAS_PER_SM * num_sms // num_kv_heads
        need = _scratch(num_heads, split_batch, 128 if head_dim < 256 else 64, head_dim)
    if tensor_cores:
        need = max(need, graph_decode_scratch(num_heads, num_kv_heads, head_dim, num_sms, max_graph_batch))
    return max(FLOOR_BYTES, need + SLACK_BYTES)
