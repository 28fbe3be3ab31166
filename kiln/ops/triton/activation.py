import torch
import triton
import triton.language as tl

from kiln.ops.triton import launch, op


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # Rounded where the reference rounds: F.silu's output, then the product.
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, act * up, mask=mask)


@op("kiln::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last dim; returns silu(gate) * up (kiln.ops.activation.silu_and_mul)."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    launch(_silu_and_mul)[(x2.shape[0], triton.cdiv(n, block))](x2, out, n, BLOCK=block)
    return out.view(*x.shape[:-1], n)
