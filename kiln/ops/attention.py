import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttnMetadata:
    """The flat batch's view of the KV cache (see DESIGN.md: the flat batch)."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes; -1 for padding
    query_start_loc: torch.Tensor  # [B+1] int32: request b's tokens are rows qsl[b]:qsl[b+1]
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    block_table: torch.Tensor  # [B, max_blocks] int32


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [num_blocks, 2, block_size, KVH, D]; padding slots (< 0) are left untouched."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = k[keep].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v[keep].to(kv_cache.dtype)


def _gather_kv(kv_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [..., n] -> K, V of shape [..., n * block_size, KVH, D] (one gather copy each)."""
    k = kv_cache[:, 0][blocks].flatten(-4, -3)
    v = kv_cache[:, 1][blocks].flatten(-4, -3)
    return k, v


@torch.library.custom_op("kiln::attention", mutates_args=("kv_cache",))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """Writes the new K/V, then attends each query to its sequence's context, causally.

    q [T, H, D], k/v [T, KVH, D] -> [T, H, D]. Decode rows (one query) run as one batched call; each
    prefill chunk runs on its own, its queries sitting at the end of its context (a cached prefix)."""
    write_kv(k, v, kv_cache, slot_mapping)
    out = torch.zeros_like(q)
    block_size = kv_cache.shape[2]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in itertools.pairwise(qsl)]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        rows = torch.tensor([qsl[i] for i in decode])
        max_len = max(lens[i] for i in decode)
        n_blocks = -(-max_len // block_size)
        kc, vc = _gather_kv(kv_cache, block_table[decode, :n_blocks])  # [Bd, L, KVH, D]
        key_pos = torch.arange(n_blocks * block_size)
        ctx = seq_lens[decode, None]
        mask = key_pos < ctx
        if sliding_window > 0:
            mask &= key_pos >= ctx - sliding_window
        out[rows] = _decode_attention(q[rows], kc, vc, mask, scale)
    for i, n in enumerate(q_lens):
        if n <= 1:
            continue
        ctx = lens[i]
        kc, vc = _gather_kv(kv_cache, block_table[i, : -(-ctx // block_size)])
        kc, vc = kc.transpose(0, 1), vc.transpose(0, 1)  # [KVH, L, D]
        q_pos = torch.arange(ctx - n, ctx)[:, None]
        key_pos = torch.arange(kc.shape[-2])[None, :]
        mask = key_pos <= q_pos
        if sliding_window > 0:
            mask &= key_pos > q_pos - sliding_window
        qi = q[qsl[i] : qsl[i + 1]].transpose(0, 1)  # [H, n, D]
        out[qsl[i] : qsl[i + 1]] = _sdpa(qi, kc, vc, mask, scale).transpose(0, 1)
    return out


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per sequence: q [B, H, D], k/v [B, L, KVH, D], mask [B, L] -> [B, H, D].
    The heads sharing a KV head act as that head's queries, so K/V are never repeated per head."""
    batch, num_heads, dim = q.shape
    num_kv_heads = k.shape[2]
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, dim)
    out = _sdpa(qg, k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], scale)
    return out.reshape(batch, num_heads, dim)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )


@attention.register_fake
def _(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table, scale, sliding_window):
    return torch.empty_like(q)
