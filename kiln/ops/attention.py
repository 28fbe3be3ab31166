"""DESIGN.md's attention seam: what a step tells the attention (AttnMetadata on the device, StepLayout on
the host) and what an implementation provides (AttentionImpl). The implementations: torch_attention.py (the
reference), cpu/attention.py, flashinfer_attention.py."""

from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import torch

# cache.kv_cache_dtype's names (config.KvCacheDtype) but auto: fp8 is e4m3, as on CUDA.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """cache.kv_cache_dtype's torch dtype ("auto": the model's)."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to the cache's dtype. An fp8 cache stores x / 1.0 (vLLM's scale where a checkpoint gives
    none) and saturates at its largest finite value, as vLLM's writers do: e4m3 has no infinity."""
    if dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


@dataclass(slots=True)
class AttnMetadata:
    """The flat batch's view of the KV cache (see DESIGN.md: the flat batch)."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes; -1 for padding
    query_start_loc: torch.Tensor  # [B+1] int32: request b's tokens are rows qsl[b]:qsl[b+1]
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    block_table: torch.Tensor  # [B, max_blocks] int32
    # Every request adds one token: attention runs in the model's graph (paged_decode), not as an opaque op.
    decode_only: bool = False

    # The dims that change from step to step (the lowering compiles them dynamic).
    STEP_DIMS: ClassVar[dict[str, tuple[int, ...]]] = {
        "slot_mapping": (0,),
        "query_start_loc": (0,),
        "seq_lens": (0,),
        "block_table": (0, 1),
    }


@dataclass(slots=True)
class StepLayout:
    """The host-side (numpy) copy of a step's batch layout, for backends that plan on the CPU."""

    query_start_loc: np.ndarray  # [B+1]
    seq_lens: np.ndarray  # [B]
    block_table: np.ndarray  # [B, width]
    decode_only: bool
    graph: bool  # the step replays a captured CUDA graph of batch B

    def paged(self, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The step's pages in CSR form, int32: (indptr [B+1], indices, last_page_len [B], kv_lens [B]).
        An empty request (a padding row) still gets one page, so no request has zero pages. Only the
        columns some request reads are scanned: a graph's table is max_model_len wide."""
        lens = self.seq_lens.astype(np.int64)
        pages = np.maximum(1, -(-lens // block_size))
        last_page_len = np.maximum(1, lens - (pages - 1) * block_size)
        table = self.block_table[:, : int(pages.max(initial=1))]
        indices = table[np.arange(table.shape[1])[None, :] < pages[:, None]]
        indptr = np.concatenate([[0], np.cumsum(pages)])
        kv_lens = (pages - 1) * block_size + last_page_len
        return (
            indptr.astype(np.int32),
            indices.astype(np.int32),
            last_page_len.astype(np.int32),
            kv_lens.astype(np.int32),
        )


class AttentionHeads(Protocol):
    """The shape of a model's attention (ModelDims has it)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int


def table_width(max_model_len: int, block_size: int) -> int:
    """Block-table columns: a longest sequence's blocks, and at least two (no size-1 specialization)."""
    return max(2, -(-max_model_len // block_size))


class AttentionImpl(Protocol):
    """Implementations of DESIGN.md's attention seam. `plan` runs once per step, before the forward and
    outside any graph; `forward` runs once per layer, inside the compiled layer graph (an implementation
    that can't be traced is a custom op, so each layer stays one graph). `graph_id`: the number the compiled
    graphs name this instance by, where its op finds it by one (0 where they name none); the compile cache
    keys by it. `own_decode_graph`: forward traces decode-only steps differently, so mixed steps need a
    graph of their own. `reads_block_table`: forward reads meta.block_table (where plan reads the host's
    table instead, the runner passes a fixed two-column stand-in)."""

    graph_id: int
    own_decode_graph: bool
    reads_block_table: bool

    def plan(self, layout: StepLayout) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttnMetadata,
        scale: float,
        sliding_window: int,
    ) -> torch.Tensor: ...
