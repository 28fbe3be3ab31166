"""FlashInfer paged attention on kiln's KV cache: one [num_blocks + 1, 2, block_size, KVH, D] tensor per
layer is FlashInfer's NHD paged layout, so the torch backend and this one read the same cache.

Decode-only steps use BatchDecodeWithPagedKVCacheWrapper (one per CUDA-graph batch size, with fixed
buffers, plus one for steps outside the graphs); prefill and mixed steps use
BatchPrefillWithPagedKVCacheWrapper, causal with the queries at the end of their context. `plan`
copies the step's page tables into the wrapper on the host side, before the forward and outside graphs."""

from __future__ import annotations

import flashinfer
import numpy as np
import torch

from kiln.ops.attention import AttnMetadata, StepLayout
from kiln.ops.triton.kv_cache import write_kv

WORKSPACE_BYTES = 256 * 2**20  # FlashInfer's split-k scratch, shared by every wrapper (one step at a time)


class FlashInferAttention:
    traceable = False  # wrapper.run is opaque to dynamo: compiled layers split around it

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_blocks_per_seq: int,
        scale: float,
        sliding_window: int,
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.max_blocks_per_seq = max_blocks_per_seq
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Tensor-core decode is faster once several query heads share a KV head (FlashInfer's advice).
        self.tensor_cores = num_heads // num_kv_heads >= 4
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores
        )
        self.graph_decode: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        # FlashInfer bakes these into the plan; every layer of a kiln model shares them.
        self.scale, self.sliding_window = scale, sliding_window
        self._active: (
            flashinfer.BatchDecodeWithPagedKVCacheWrapper | flashinfer.BatchPrefillWithPagedKVCacheWrapper
        )
        self._active = self.prefill

    def _graph_wrapper(self, batch: int) -> flashinfer.BatchDecodeWithPagedKVCacheWrapper:
        if batch not in self.graph_decode:
            i32 = {"dtype": torch.int32, "device": self.device}
            self.graph_decode[batch] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(batch + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(batch * self.max_blocks_per_seq, **i32),
                paged_kv_last_page_len_buffer=torch.zeros(batch, **i32),
            )
        return self.graph_decode[batch]

    def plan(self, layout: StepLayout) -> None:
        lens = layout.seq_lens.astype(np.int64)
        # An empty request (a padding row) still gets one page, so no request has zero pages.
        pages = np.maximum(1, -(-lens // self.block_size))
        last_page_len = np.maximum(1, lens - (pages - 1) * self.block_size).astype(np.int32)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        table = layout.block_table
        indices = table[np.arange(table.shape[1])[None, :] < pages[:, None]].astype(np.int32)
        host = [torch.from_numpy(a) for a in (indptr, indices, last_page_len)]
        common = {
            "num_qo_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "page_size": self.block_size,
            "window_left": self.sliding_window - 1 if self.sliding_window > 0 else -1,
            "sm_scale": self.scale,
            "q_data_type": self.dtype,
            "kv_data_type": self.dtype,
        }
        if layout.decode_only:
            batch = len(lens)
            self._active = self._graph_wrapper(batch) if layout.graph else self.decode
            self._active.plan(*host, head_dim=self.head_dim, **common)
            return
        qo_indptr = torch.from_numpy(layout.query_start_loc.astype(np.int32))
        self._active = self.prefill
        self.prefill.plan(qo_indptr, *host, head_dim_qk=self.head_dim, causal=True, **common)

    @torch.compiler.disable
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
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return self._active.run(q.contiguous(), kv_cache)
