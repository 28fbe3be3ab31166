import torch
import triton
import triton.language as tl

from kiln.ops.triton import launch, op


@triton.jit
def _rms_norm(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        # Rounded as the reference's `x + residual` is, before the statistics.
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row + cols, x, mask=mask)
        x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + cols, w * normed, mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    out = torch.empty_like(x2)
    total = torch.empty_like(x2) if residual is not None else out
    res = residual.reshape(-1, n).contiguous() if residual is not None else x2
    launch(_rms_norm)[(x2.shape[0],)](
        x2, res, weight, out, total, n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return out.view(x.shape), total.view(x.shape)


@op("kiln::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


@op("kiln::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """kiln.ops.norm.rms_norm fused into one pass: (norm(x + residual), x + residual)."""
    if residual is None:
        return _rms_norm_op(x, weight, eps), x
    return _add_rms_norm_op(x, residual, weight, eps)
