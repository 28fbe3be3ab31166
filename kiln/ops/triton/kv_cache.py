import torch
import triton
import triton.language as tl

from kiln.ops.triton import launch, op


@triton.jit
def _write_kv(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    k_row,
    v_row,
    block_size,
    width,
    LIMIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    slot = tl.load(slot_ptr + tl.program_id(0)).to(tl.int64)
    if slot >= 0:
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        # Cache [num_blocks, 2, block_size, KVH * D]: K then V within each block.
        dst = cache_ptr + ((slot // block_size) * 2 * block_size + slot % block_size) * width + cols
        k = tl.load(k_ptr + t * k_row + cols, mask=mask)
        v = tl.load(v_ptr + t * v_row + cols, mask=mask)
        if LIMIT > 0:  # an fp8 cache saturates (kiln.ops.attention.to_cache); the cast rounds to nearest even
            k = tl.minimum(tl.maximum(k.to(tl.float32), -LIMIT), LIMIT)
            v = tl.minimum(tl.maximum(v.to(tl.float32), -LIMIT), LIMIT)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + block_size * width, v.to(cache_ptr.dtype.element_ty), mask=mask)


@op("kiln::write_kv", mutates_args=("kv_cache",))
def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kiln.ops.torch_attention.write_kv, except that padding slots (-1) write nothing at all.
    k/v [T, KVH, D] may be views of the fused qkv output; kv_cache [N, 2, block_size, KVH, D]."""
    width = k.shape[1] * k.shape[2]
    assert k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2], "K/V heads must be contiguous"
    block = min(triton.next_power_of_2(width), 1024)
    limit = torch.finfo(kv_cache.dtype).max if kv_cache.dtype.itemsize == 1 else 0.0
    launch(_write_kv)[(k.shape[0], triton.cdiv(width, block))](
        k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0), kv_cache.shape[2], width, limit, BLOCK=block
    )
