"""Fused MoE as vLLM's fused_moe does it: token-expert pairs are sorted by expert and padded to whole
row blocks, so each program of one grouped-GEMM launch multiplies a block of rows by its expert's
weights. No host sync anywhere: the launch and its grouping are CUDA-graph capturable."""

import torch
import triton
import triton.language as tl

from kiln.ops.triton import INTERPRET, launch, op
from kiln.ops.triton.activation import silu_and_mul


@triton.jit
def _grouped_gemm(
    a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ptr, expert_ptr, padded_ptr,
    num_pairs, n, k, a_row, b_expert, b_row, c_row,
    SECOND: tl.constexpr, TOP_K: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """C[pair] = A[row of pair] @ B[expert]^T (times the pair's routing weight), for one block of pairs.
    B is [E, N, K] (nn.Linear's layout). The first GEMM reads the pair's token row of x; the SECOND reads
    the pair's own row of h and applies the routing weight."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    rows = pairs if SECOND else pairs // TOP_K
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + inner
        a = tl.load(
            a_ptr + rows[:, None] * a_row + ks[None, :], mask=valid[:, None] & (ks[None, :] < k), other=0.0
        )
        b = tl.load(
            b_ptr + expert * b_expert + cols[None, :] * b_row + ks[:, None],
            mask=(cols[None, :] < n) & (ks[:, None] < k),
            other=0.0,
        )
        if UPCAST:
            # IEEE float32, not TF32 (Triton's default for float32 inputs on a GPU): torch's float32 GEMMs.
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b.to(a.dtype))
    if SECOND:
        acc = acc.to(c_ptr.dtype.element_ty).to(tl.float32)  # the reference rounds the GEMM first
        acc *= tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs[:, None] * c_row + cols[None, :], acc, mask=valid[:, None] & (cols[None, :] < n))


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-expert pairs (ids [T, k]) grouped by expert, each group padded to a multiple of block_m.
    Returns (pair index per padded row, num_pairs where padding; expert per row block; padded total)."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert_sorted]
    max_rows = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int64, device=ids.device)
    sorted_pairs[(padded_end - padded)[expert_sorted] + rank] = order
    block_start = torch.arange(0, max_rows, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).clamp_max(num_experts - 1)
    return sorted_pairs, block_expert, padded_end[-1:]


def _gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pair_weights: torch.Tensor,
    groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int, second: bool, block_m: int,
) -> None:  # fmt: skip
    """The first GEMM reads token rows of x; the second reads pair rows of h and applies the weights."""
    sorted_pairs, block_expert, padded = groups
    n, k = w.shape[1], w.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    launch(_grouped_gemm)[(block_expert.numel(), triton.cdiv(n, block_n))](
        a, w, out, pair_weights, sorted_pairs, block_expert, padded,
        pair_weights.numel(), n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        # The interpreter's 16-bit dot products upcast wrongly; float32 operands multiply as float32.
        SECOND=second, TOP_K=top_k, UPCAST=INTERPRET or torch.float32 in (a.dtype, w.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


@op("kiln::fused_moe", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    deterministic: bool = False,
) -> torch.Tensor:
    """kiln.ops.moe.moe_experts as two grouped GEMMs: x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    weights/ids [T, k] -> [T, H]. deterministic (batch-invariant): one row tile whatever the step's size,
    and a token's k results added one at a time, in rank order, rather than by a reduction whose split
    the output's size picks."""
    num_tokens, top_k = ids.shape
    block_m = 16 if deterministic or num_tokens * top_k <= 64 * w13.shape[0] else 64
    groups = align_by_expert(ids, w13.shape[0], block_m)
    pair_weights = weights.flatten().float()
    x = x.contiguous()
    gate_up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, pair_weights, groups, top_k, False, block_m)
    h = silu_and_mul(gate_up)
    out = torch.empty(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    _gemm(h, w2, out, pair_weights, groups, top_k, True, block_m)
    out = out.view(num_tokens, top_k, -1)
    if not deterministic:
        return out.sum(dim=1)
    total = out[:, 0]
    for j in range(1, top_k):
        total = total + out[:, j]
    return total
