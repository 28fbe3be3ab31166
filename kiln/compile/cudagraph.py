"""CUDA graphs for decode steps, one per decode bucket: the whole forward (compiled layers, Triton kernels,
FlashInfer's run) is recorded once and replayed with the step's inputs copied into static buffers,
so a decode step costs a few copies and one launch instead of a launch per kernel."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.ops.attention import AttnMetadata

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # the static buffers (views of CudaGraphs' shared ones) a replay fills
    output: torch.Tensor


def _step_tensors(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The model's step arguments but the KV caches: ids, positions, the attention metadata's tensors, and
    the tokens' LoRA slots where the model has them."""
    input_ids, positions, _, meta, lora_slots = args
    tensors = [input_ids, positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_table]
    return tensors if lora_slots is None else [*tensors, lora_slots]


class CudaGraphs:
    def __init__(self) -> None:
        self.captured: dict[int, _Graph] = {}
        self.pool: Any = None  # one memory pool, shared by every graph (they never run at once)
        self.seconds = 0.0  # spent recording, beyond the warm-up run that compiles
        self._buffers: list[torch.Tensor] = []  # flat, one per step tensor: every graph's inputs view them

    def _static(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of the step's tensors in buffers every graph shares, as they share the pool: a replay fills
        its inputs, then runs, one step after the other. Graphs are captured largest first, so the first
        sizes the buffers. One set each would hold its batch's full-width block table: 100 MB and more
        over 51 graphs at long max_model_len, made after the KV cache took the rest of the budget."""
        static = []
        for i, t in enumerate(tensors):
            flat = self._buffers[i] if i < len(self._buffers) else None
            if flat is None or flat.numel() < t.numel() or flat.dtype != t.dtype:
                # A graph captured before keeps the old buffer through its views.
                flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
                self._buffers[i : i + 1] = [flat]
            static.append(flat[: t.numel()].view(t.shape).copy_(t))
        return static

    def capture(
        self, batch: int, forward: Callable[..., torch.Tensor], args: tuple[Any, ...]
    ) -> torch.Tensor:
        """Runs the step once (compiling what it needs), then records it. The runner has already planned
        the attention backend for this batch, so the recorded kernels read the planned buffers."""
        kv_caches, meta = args[2], args[3]
        static = self._static(_step_tensors(args))
        static_meta = AttnMetadata(*static[2:6], decode_only=meta.decode_only)
        static_args = (static[0], static[1], kv_caches, static_meta, static[6] if len(static) > 6 else None)
        forward(*static_args)
        torch.cuda.synchronize()
        clock = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward(*static_args)
        self.pool = graph.pool()
        self.seconds += time.perf_counter() - clock
        self.captured[batch] = _Graph(graph, static, output)
        log.debug("captured the decode graph of batch %d", batch)
        return self.replay(batch, args)

    def replay(self, batch: int, args: tuple[Any, ...]) -> torch.Tensor:
        g = self.captured[batch]
        for buffer, value in zip(g.inputs, _step_tensors(args), strict=True):
            buffer.copy_(value, non_blocking=True)
        g.graph.replay()
        return g.output
