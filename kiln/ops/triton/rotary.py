import torch
import triton
import triton.language as tl

from kiln.ops.triton import launch, op


@triton.jit
def _rotate_heads(x_ptr, row_stride, head_stride, cos, sin, n_heads, half,
                  NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (i < half)
    base = x_ptr + tl.program_id(0).to(tl.int64) * row_stride + heads * head_stride
    # neox pairs element i with i + half; GPT-J pairs 2i with 2i + 1.
    first = base + (i if NEOX else 2 * i)
    second = base + (i + half if NEOX else 2 * i + 1)
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, x1 * cos - x2 * sin, mask=mask)
    tl.store(second, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def _rotary(pos_ptr, q_ptr, k_ptr, cos_sin_ptr, q_row, q_head, k_row, k_head, n_q, n_k, half,
            NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
            BLOCK_D: tl.constexpr):  # fmt: skip
    pos = tl.load(pos_ptr + tl.program_id(0)).to(tl.int64)
    i = tl.arange(0, BLOCK_D)[None, :]
    cos = tl.load(cos_sin_ptr + pos * 2 * half + i, mask=i < half, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * 2 * half + half + i, mask=i < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_row, q_head, cos, sin, n_q, half, NEOX, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, k_row, k_head, cos, sin, n_k, half, NEOX, BLOCK_HK, BLOCK_D)


@op("kiln::rotary_", mutates_args=("q", "k"))
def _rotary_op(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, neox: bool
) -> None:
    half = cos_sin.shape[-1] // 2
    launch(_rotary)[(q.shape[0],)](
        positions, q, k, cos_sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q.shape[1], k.shape[1], half, NEOX=neox,
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_D=triton.next_power_of_2(half),
    )  # fmt: skip


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """kiln.ops.rotary.apply_rotary, rotating q [T, H, D] and k [T, KVH, D] in place (both may be views
    of the fused qkv output: only the last dim must be contiguous). Returns them."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary needs the head dim contiguous"
    _rotary_op(positions, q, k, cos_sin.contiguous(), neox)
    return q, k
