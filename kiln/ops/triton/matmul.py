"""A batch-invariant GEMM, y = x @ W^T (+ bias), for the deterministic mode: one tile shape for every M, no
split-K, and each output element's K walked from 0 in the same BLOCK_K steps, so a row's result never
depends on how many rows share the call or where it sits among them (cuBLAS picks its kernel, split-K
included, by M). Weights stay as loaded ([N, K]); accumulation is float32."""

import torch
import triton
import triton.language as tl

from kiln.ops.matmul import SeparateGateUp
from kiln.ops.triton import INTERPRET, launch, op

# The one tile shape (never chosen by M): 64 rows suit Hopper's wgmma, 64 columns keep decode steps'
# weight reads spread over enough programs.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


# M is not specialized (Triton specializes ints equal to 1 or divisible by 16): one compiled kernel for all M.
@triton.jit(do_not_specialize=["m"])
def _matmul(
    x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, x_row, w_row, y_row,
    HAS_BIAS: tl.constexpr, FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + inner
        a_mask = (rows[:, None] < m) & (ks[None, :] < k)
        a = tl.load(x_ptr + rows[:, None] * x_row + ks[None, :], mask=a_mask, other=0.0)
        b_mask = (cols[None, :] < n) & (ks[:, None] < k)
        b = tl.load(w_ptr + cols[None, :] * w_row + ks[:, None], mask=b_mask, other=0.0)
        if FP32:
            # IEEE float32, not TF32: torch's default for float32 GEMMs.
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.to(a.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * y_row + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < m) & (cols[None, :] < n))


@op("kiln::invariant_matmul", mutates_args=())
def invariant_matmul(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int, fp32_out: bool
) -> torch.Tensor:
    """x [..., K] @ w[:n]^T (+ bias) -> [..., n] in x's dtype, or float32 with fp32_out."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32 if fp32_out else x.dtype, device=x.device)
    # The interpreter gets 16-bit dot products wrong: it upcasts.
    fp32 = INTERPRET or x.dtype == torch.float32 or w.dtype == torch.float32
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    launch(_matmul)[grid](
        x2, w, bias if bias is not None else w, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, FP32=fp32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)


class TritonMatmul(SeparateGateUp):
    """kiln.ops.matmul.Matmul on weights as loaded, batch-invariant (the deterministic mode's GEMM)."""

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def pack_bias(self, bias: torch.Tensor) -> torch.Tensor:
        return bias

    def pack_head(self, head: torch.Tensor) -> torch.Tensor:
        return head

    def pack_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w13, w2

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        return invariant_matmul(x, weight, bias, n, False)

    def logits(self, hidden: torch.Tensor, head: torch.Tensor, n: int) -> torch.Tensor:
        # As TorchMatmul: a 16-bit head multiplies hidden rounded to its dtype.
        x = hidden.float() if head.dtype == torch.float32 else hidden.to(head.dtype)
        return invariant_matmul(x, head, None, n, True)
