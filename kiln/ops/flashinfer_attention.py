"""FlashInfer paged attention on kiln's KV cache: one [num_blocks + 1, 2, block_size, KVH, D] tensor per
layer is FlashInfer's NHD paged layout, so the torch backend and this one read the same cache.

Decode-only steps use BatchDecodeWithPagedKVCacheWrapper (one per CUDA-graph batch size, with fixed
buffers, plus one for steps outside the graphs); prefill and mixed steps use
BatchPrefillWithPagedKVCacheWrapper, causal with the queries at the end of their context. `plan`
copies the step's page tables into the wrapper on the host side, before the forward and outside graphs.

Deterministic mode (batch-invariant attention) runs every step, decode-only ones included, through the
prefill wrapper (graph-captured decode steps through one of fixed buffers per batch size) with
`disable_split_kv=True`, so each query row is reduced in one CTA over the same KV tiles whatever its batch:
- On Hopper, FlashInfer 0.5.3 prefills with FA3 (PrefillSM90Plan, which ignores disable_split_kv): its
  tile is fixed by the head dim (CTA_Q 128, 192 at head dim 64) and it never splits the KV. FA2 (tensor-
  core decode, and prefill off Hopper) picks its query tile from the step's mean query length
  (FA2DetermineCtaTileQ: 16 for decodes, 64 or 128 for prefills), which changes the warp layout and so
  the reduction order (flashinfer#2424).
- A decode row in a mixed step already runs in the prefill kernel, and a prompt's last token is a one-row
  query after a prefix-cache hit: one kernel for both keeps a row's bits independent of the step kind.
- CUDA-core decode ignores disable_split_kv (its plan takes no such argument) and refuses
  fixed_split_size; split-KV with a fixed split size is not CUDA-graph safe (FlashInfer's docstring)."""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, TypeVar

import flashinfer
import numpy as np
import torch

from kiln.ops.attention import AttnMetadata, StepLayout
from kiln.ops.flashinfer_modules import build_kernels, prefill_backend
from kiln.ops.flashinfer_workspace import workspace_bytes
from kiln.ops.transfer import pinned, to_device
from kiln.ops.triton.kv_cache import write_kv

log = logging.getLogger(__name__)

INT_WORKSPACE_BYTES = 8 * 2**20  # each plan's schedule, the size every wrapper would allocate for itself
# Where a plan's per-CTA indices lie: 3 int32 arrays of the padded grid (a few thousand CTAs) and the
# query pointers come first (scheduler.cuh, PrefillPlan).
SCHEDULE_HEAD_BYTES = 2**20

Wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper | flashinfer.BatchPrefillWithPagedKVCacheWrapper
W = TypeVar(
    "W", flashinfer.BatchDecodeWithPagedKVCacheWrapper, flashinfer.BatchPrefillWithPagedKVCacheWrapper
)

# The custom op below takes tensors and an int, not a Python object: each backend is found by its id.
_LIVE: weakref.WeakValueDictionary[int, FlashInferAttention] = weakref.WeakValueDictionary()
_IDS = itertools.count()


class FlashInferAttention:
    """forward is one custom op, opaque to dynamo but no graph break: each layer stays one graph. (A
    graph break left resume functions with static shapes, which recompiled for each new step size.)"""

    own_decode_graph = False  # the same op for every step; plan() tells decode from mixed
    reads_block_table = False  # plan() gives the wrappers the step's pages

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
        max_blocks_per_seq: int,
        scale: float,
        sliding_window: int,
        max_graph_batch: int,
        deterministic: bool = False,
    ) -> None:
        """dtype: the queries' and outputs'; kv_dtype: the cache's (fp8 takes FA2 prefill: FlashInfer's FA3
        needs fp8 queries with it). max_graph_batch: the largest decode CUDA graph's batch, which sizes the
        shared split-KV scratch."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.deterministic = deterministic
        self.block_size, self.dtype, self.kv_dtype, self.device = block_size, dtype, kv_dtype, device
        self.max_blocks_per_seq = max_blocks_per_seq
        # Tensor-core decode is faster once several query heads share a KV head (FlashInfer's advice).
        self.tensor_cores = num_heads // num_kv_heads >= 4
        self.prefill_backend = prefill = prefill_backend(dtype, kv_dtype, device)
        fa2_prefill = prefill != "fa3"
        self.fa3 = not fa2_prefill
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        size = workspace_bytes(
            num_heads, num_kv_heads, head_dim, sms, max_graph_batch, self.tensor_cores, fa2_prefill
        )
        self.workspace = torch.zeros(size, dtype=torch.uint8, device=device)
        self.int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.pinned_int_workspace = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True)
        # Named, not "auto" (which resolves to the same at plan): off Hopper, "auto" would also allocate FA3's
        # 64 MiB token index, which FA2 never reads.
        self.prefill = self._wrapper(flashinfer.BatchPrefillWithPagedKVCacheWrapper, backend=prefill)
        self.decode = self._wrapper(
            flashinfer.BatchDecodeWithPagedKVCacheWrapper, use_tensor_cores=self.tensor_cores
        )
        self.graph_decode: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        self.graph_prefill: dict[int, flashinfer.BatchPrefillWithPagedKVCacheWrapper] = {}
        self._indices: torch.Tensor | None = None
        # Deterministic decode graphs read FA3's page-to-token index at the address they were captured
        # with, so it cannot grow as a mixed step's does (_fit_token_index). It is sized here, before the
        # memory profile, for a whole graph batch at max_model_len; up to FlashInfer's 16M, the prefill's
        # is shared.
        self._graph_token_index: torch.Tensor | None = None
        if deterministic and self.fa3:
            have = self.prefill._vector_sparse_indices_buffer
            need = max_graph_batch * max_blocks_per_seq * block_size
            self._graph_token_index = (
                have if need <= have.numel() else torch.empty(need, dtype=torch.int32, device=device)
            )
        build_kernels(head_dim, dtype, kv_dtype, prefill, sliding_window > 0, self.tensor_cores)
        if deterministic and fa2_prefill:
            log.warning(
                "deterministic: FlashInfer prefills with FA2 on this GPU, whose query tile follows the "
                "step's mean query length (flashinfer#2424): attention may still depend on the batch"
            )
        # FlashInfer bakes these into the plan; every layer of a kiln model shares them.
        self.scale, self.sliding_window = scale, sliding_window
        self._active: Wrapper = self.prefill
        # plan() stages its tables in pinned host buffers that the device copies from later. Under async
        # scheduling the next plan comes while the last step still runs: it waits for those copies first.
        self._planned = torch.cuda.Event()
        self.graph_id = next(_IDS)
        _LIVE[self.graph_id] = self

    def _wrapper(self, cls: type[W], **options: Any) -> W:
        """Every wrapper, on the shared workspaces. A plan writes its schedule into the int workspace and the
        run it plans reads it, in stream order, one step after the other, as with the float workspace. The
        CUDA-graph wrappers are made during capture, after the KV cache took what the memory profile left:
        8 MiB each of their own (up to 51 of them) would go over gpu_memory_utilization. The schedule is
        staged in pinned host memory, also shared: the next plan, of whichever wrapper, waits for the last
        one's copy out of it (plan()), and 8 MiB pinned per wrapper would hold 400 MiB of the host's RAM."""
        wrapper = cls(self.workspace, "NHD", **options)
        wrapper.reset_workspace_buffer(self.workspace, self.int_workspace)
        wrapper._pin_memory_int_workspace_buffer = self.pinned_int_workspace
        return wrapper

    def _graph_indices(self, batch: int) -> torch.Tensor:
        """The graphs' page indices, one buffer for all (made at the first graph's size, the largest: they are
        captured largest first). A step's plan fills it and its graph reads it, in stream order, one step
        after the other, as a graph shares its own buffers between its steps. One each would hold a batch's
        rows times max_model_len's pages for every one of up to 51 graphs (hundreds of MB at 128k tokens)."""
        need = batch * self.max_blocks_per_seq
        if self._indices is None or self._indices.numel() < need:
            self._indices = torch.zeros(need, dtype=torch.int32, device=self.device)
        return self._indices[:need]

    def _graph_wrapper(self, batch: int) -> flashinfer.BatchDecodeWithPagedKVCacheWrapper:
        if batch not in self.graph_decode:
            i32 = {"dtype": torch.int32, "device": self.device}
            self.graph_decode[batch] = self._wrapper(
                flashinfer.BatchDecodeWithPagedKVCacheWrapper,
                use_cuda_graph=True,
                use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(batch + 1, **i32),
                paged_kv_indices_buffer=self._graph_indices(batch),
                paged_kv_last_page_len_buffer=torch.zeros(batch, **i32),
            )
        return self.graph_decode[batch]

    def _graph_prefill(self, batch: int) -> flashinfer.BatchPrefillWithPagedKVCacheWrapper:
        """Deterministic mode's decode graphs: the prefill kernel on fixed buffers, one query per request."""
        if batch not in self.graph_prefill:
            i32 = {"dtype": torch.int32, "device": self.device}
            wrapper = self._wrapper(
                flashinfer.BatchPrefillWithPagedKVCacheWrapper,
                backend=self.prefill_backend,
                use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(batch + 1, **i32),
                paged_kv_indptr_buf=torch.zeros(batch + 1, **i32),
                paged_kv_indices_buf=self._graph_indices(batch),
                paged_kv_last_page_len_buf=torch.zeros(batch, **i32),
            )
            # FA3's page-to-token index is written and read within one run (one step at a time, as the
            # workspace): every wrapper shares one rather than holding 64 MiB of its own.
            if self._graph_token_index is not None:
                wrapper._vector_sparse_indices_buffer = self._graph_token_index
            self.graph_prefill[batch] = wrapper
        return self.graph_prefill[batch]

    def _fit_token_index(self, tokens: int) -> None:
        """FA3 expands a step's pages into one index per KV token, in a buffer FlashInfer sizes for 16M. A
        mixed step can read more: 1,024 requests on one cached 16k-token prefix. It grows (past the memory
        profile) rather than let the kernel write beyond it. (Deterministic mode's decode graphs have their
        own, sized for them at init.)"""
        if not self.fa3 or tokens <= (have := self.prefill._vector_sparse_indices_buffer).numel():
            return
        size = max(tokens, 2 * have.numel())
        log.warning("FlashInfer's FA3 token index grows to %d tokens (%d MiB)", size, size * 4 // 2**20)
        self.prefill._vector_sparse_indices_buffer = torch.empty(size, dtype=torch.int32, device=self.device)

    def plan(self, layout: StepLayout) -> None:
        self._planned.synchronize()
        self._plan(layout)
        self._planned.record()

    def _plan(self, layout: StepLayout) -> None:
        indptr, indices, last_page_len, kv_lens = layout.paged(self.block_size)
        # plan() reads the page pointers and lengths on the host and copies them from pinned memory without a
        # sync; host page indices it would copy into a CUDA-graph wrapper's buffer blocking (a sync), so they
        # go to the device first.
        paged = [pinned(indptr), to_device(indices, None, self.device), pinned(last_page_len)]
        tokens = int(kv_lens.sum())
        # The KV lengths, as FlashInfer would compute them from the pages: given pinned, the prefill plan's
        # copy of them is queued too.
        kv_lens = pinned(kv_lens)
        common = {
            "num_qo_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "page_size": self.block_size,
            "window_left": self.sliding_window - 1 if self.sliding_window > 0 else -1,
            "sm_scale": self.scale,
            "q_data_type": self.dtype,
            "kv_data_type": self.kv_dtype,
        }
        qo_indptr = pinned(layout.query_start_loc.astype(np.int32))
        if self.deterministic:
            if not layout.graph:
                self._fit_token_index(tokens)
            self._active = self._graph_prefill(len(layout.seq_lens)) if layout.graph else self.prefill
            if layout.graph and not self.fa3:
                # FA2's graph grid is padded past the step's tiles, and without split-KV no mask stops the
                # padding CTAs: each reads its request and tile index from the schedule, whose padding the
                # plan never writes. In the shared pinned buffer that is another plan's; zeros make them all
                # recompute request 0's first tile, writing the same bits.
                self.pinned_int_workspace[:SCHEDULE_HEAD_BYTES].zero_()
            self._active.plan(
                qo_indptr, *paged, head_dim_qk=self.head_dim, causal=True, disable_split_kv=True,
                seq_lens=kv_lens, **common,
            )  # fmt: skip
            return
        if layout.decode_only:
            batch = len(layout.seq_lens)
            self._active = self._graph_wrapper(batch) if layout.graph else self.decode
            self._active.plan(*paged, head_dim=self.head_dim, **common)
            return
        self._active = self.prefill
        self._fit_token_index(tokens)
        self.prefill.plan(
            qo_indptr, *paged, head_dim_qk=self.head_dim, causal=True, seq_lens=kv_lens, **common
        )

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
        return flashinfer_attention(q, k, v, kv_cache, meta.slot_mapping, self.graph_id)


@torch.library.custom_op("kiln::flashinfer_attention", mutates_args=("kv_cache",))
def flashinfer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend_id: int,
) -> torch.Tensor:
    """Writes the new K/V, then runs the wrapper the backend's last plan chose."""
    write_kv(k, v, kv_cache, slot_mapping)
    return _LIVE[backend_id]._active.run(q.contiguous(), kv_cache)


@flashinfer_attention.register_fake
def _(q, k, v, kv_cache, slot_mapping, backend_id):
    return torch.empty_like(q)
