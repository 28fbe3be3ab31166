"""TorchAttention and what it runs: write_kv, the kiln::attention op for mixed steps, and paged_decode for
decode-only steps (traced into the layer graphs)."""

import functools
import itertools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.ops.attention import AttnMetadata, StepLayout, to_cache
from kiln.platform import has_cxx

log = logging.getLogger(__name__)


class TorchAttention:
    """The reference backend: runs anywhere, and traces into the compiled layer graphs."""

    graph_id = 0
    own_decode_graph = True
    reads_block_table = True

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
        if meta.decode_only:
            return decode_attention(q, k, v, kv_cache, meta, scale, sliding_window)
        return attention(
            q,
            k,
            v,
            kv_cache,
            meta.slot_mapping,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            scale,
            sliding_window,
        )


TORCH_ATTENTION = TorchAttention()


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [num_blocks + 1, 2, block_size, KVH, D]. Its last block is the padding block, which the block
    manager never hands out: a padding slot (-1) lands there, so the write is one mask-free scatter that
    traces into a compiled graph, and no real block is touched."""
    block_size = kv_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")  # -1 -> -1, the padding block
    row = blocks * (2 * block_size) + slot_mapping % block_size  # K's row in the flat view; V's is bs on
    # One scatter into a flat view of the whole cache: Inductor does it in place (a scatter into a
    # kv_cache[:, 0] slice compiled into a copy of the entire cache, 100x slower).
    flat = kv_cache.view(-1, *kv_cache.shape[3:])
    flat[torch.cat([row, row + block_size])] = to_cache(torch.cat([k, v]), kv_cache.dtype)


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
        # At least two rows and two blocks: the compiled kernel then needs no size-1 specialization.
        decode = decode * 2 if len(decode) == 1 else decode
        rows = torch.tensor([qsl[i] for i in decode], device=q.device)
        n_blocks = max(2, -(-max(lens[i] for i in decode) // block_size))
        tables = block_table[decode, :n_blocks].contiguous()
        out[rows] = _paged_decode()(q[rows], kv_cache, tables, seq_lens[decode], scale, sliding_window)
    for i, n in enumerate(q_lens):
        if n <= 1:
            continue
        ctx = lens[i]
        kc, vc = _gather_kv(kv_cache, block_table[i, : -(-ctx // block_size)])
        kc, vc = kc.transpose(0, 1), vc.transpose(0, 1)  # [KVH, L, D]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        key_pos = torch.arange(kc.shape[-2], device=q.device)[None, :]
        mask = key_pos <= q_pos
        if sliding_window > 0:
            mask &= key_pos > q_pos - sliding_window
        qi = q[qsl[i] : qsl[i + 1]].transpose(0, 1)  # [H, n, D]
        out[qsl[i] : qsl[i + 1]] = _sdpa(qi, kc, vc, mask, scale).transpose(0, 1)
    return out


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """Attention for a decode-only step, one query row per sequence. Every row has a block-table row and a
    length (a padding row writes into the padding block and reads block 0), so no Python runs per row
    and the whole thing traces into the model's compiled graph."""
    write_kv(k, v, kv_cache, meta.slot_mapping)
    if torch.compiler.is_compiling():
        return paged_decode(q, kv_cache, meta.block_table, meta.seq_lens, scale, sliding_window)
    return _paged_decode()(q, kv_cache, meta.block_table, meta.seq_lens, scale, sliding_window)


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """One query per sequence, straight from the paged cache: q [B, H, D] -> [B, H, D].

    Written as gather, multiply and reduce so that Inductor fuses the block-table gather into the
    reductions: compiled, it reads each K/V once instead of copying it out first (about 3x faster
    on the 2-core CPU). Heads sharing a KV head are grouped, so K/V are never repeated per head."""
    batch, num_heads, dim = q.shape
    num_blocks, block_size, num_kv_heads = block_table.shape[1], kv_cache.shape[2], kv_cache.shape[3]
    qg = q.view(batch, 1, 1, num_kv_heads, num_heads // num_kv_heads, dim).float()
    kv = kv_cache[block_table]  # [B, n, 2, bs, KVH, D]
    scores = (qg * kv[:, :, 0].unsqueeze(-2).float()).sum(-1) * scale  # [B, n, bs, KVH, G]
    pos = torch.arange(num_blocks * block_size, device=q.device).view(1, num_blocks, block_size, 1, 1)
    ctx = seq_lens.view(-1, 1, 1, 1, 1)
    masked = pos >= ctx
    if sliding_window > 0:
        masked |= pos < ctx - sliding_window
    scores = scores.masked_fill(masked, float("-inf"))
    probs = (scores - scores.amax(dim=(1, 2), keepdim=True)).exp()
    probs = probs / probs.sum(dim=(1, 2), keepdim=True)
    out = (probs.unsqueeze(-1) * kv[:, :, 1].unsqueeze(-2).float()).sum(dim=(1, 2))  # [B, KVH, G, D]
    return out.reshape(batch, num_heads, dim).to(q.dtype)


@functools.cache
def _paged_decode() -> Callable[..., torch.Tensor]:
    """paged_decode compiled once per process, for eager steps and mixed steps' decode rows (Inductor's
    disk cache makes later processes quick); eager where no C++ compiler is found. Only the batch, the
    block-table width and the cache's block count are dynamic: symbolic head dims made tracing several
    times slower. The block count is marked here too, not only by the layer graphs' trace (groups.py), so a
    start that loads those graphs traces this one as the start that traced them did (torch 2.11 left the
    first's marks on the caches, and the two missed each other's Inductor cache entry)."""
    if not has_cxx():
        log.warning("no C++ compiler found: paged decode attention runs eagerly (slower)")
        return paged_decode
    compiled = torch.compile(paged_decode, dynamic=False)

    def run(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int,
    ) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(q, 0)
        torch._dynamo.maybe_mark_dynamic(seq_lens, 0)
        torch._dynamo.maybe_mark_dynamic(block_table, 0)
        torch._dynamo.maybe_mark_dynamic(block_table, 1)
        torch._dynamo.maybe_mark_dynamic(kv_cache, 0)
        return compiled(q, kv_cache, block_table, seq_lens, scale, sliding_window)

    return run


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )


@attention.register_fake
def _(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table, scale, sliding_window):
    return torch.empty_like(q)
