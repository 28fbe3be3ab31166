"""LoRA adapters in the model: each adapted linear layer holds every slot's A and B stacked, and a step
adds x A^T B^T for each token's slot as two dense matmuls under a mask, so the graphs keep one shape
whichever adapters a step mixes (vLLM's punica kernels gather per token instead; at a few slots of rank 16
the dense form costs a few percent of the layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.ops.matmul import Matmul


@dataclass(frozen=True, slots=True)
class LoraDims:
    max_loras: int  # slots: the most adapters one step runs
    max_rank: int  # each slot's rank; a smaller adapter is padded with zeros
    dtype: torch.dtype | None = None  # the adapters' precision (None: as read); slots hold activations' dtype

    @property
    def width(self) -> int:
        return self.max_loras * self.max_rank


class LoraStack(nn.Module):
    """A linear layer's adapters, for its shards (q, k, v of a fused projection: each its own adapter),
    multiplied by the layer's own Matmul (Inductor's code for these small GEMMs cost a batch-16 CPU step
    more than the adapters' arithmetic). A: [shards * slots * rank, in], rows of shard s, slot j at
    (s * slots + j) * rank; B: [out, shards * slots * rank], block-diagonal over the shards, each B scaled
    by its adapter's alpha / r. `a` and `b` are them in the Matmul's layout, rewritten in place when a slot
    changes (graphs hold them); `raw_a` and `raw_b` as written."""

    def __init__(self, dims: LoraDims, in_features: int, shards: list[int], matmul: Matmul) -> None:
        super().__init__()
        self.dims, self.shards, self.matmul = dims, shards, matmul
        self.offsets = [sum(shards[:s]) for s in range(len(shards))]
        self.cols, self.in_features, self.out_features = len(shards) * dims.width, in_features, sum(shards)
        self.raw_a = torch.empty(0)
        self.raw_b = torch.empty(0)
        self.a: nn.Parameter | None = None
        self.b: nn.Parameter | None = None

    @classmethod
    def of(
        cls, dims: LoraDims | None, in_features: int, shards: list[int], matmul: Matmul
    ) -> LoraStack | None:
        return None if dims is None else cls(dims, in_features, shards, matmul)

    def reset(self, dtype: torch.dtype, device: torch.device) -> None:
        """Empty slots, in the activations' dtype (after loading, as the base weights are packed)."""
        self.raw_a = torch.zeros(self.cols, self.in_features, dtype=dtype, device=device)
        self.raw_b = torch.zeros(self.out_features, self.cols, dtype=dtype, device=device)
        self.a = nn.Parameter(self.matmul.pack(self.raw_a), requires_grad=False)
        self.b = nn.Parameter(self.matmul.pack(self.raw_b), requires_grad=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """mask [tokens, slots * rank]: 1 on the columns of each token's slot, 0 elsewhere (no adapter)."""
        assert self.a is not None and self.b is not None, "reset() after loading"
        xa = self.matmul.linear(x, self.a, None, self.cols) * mask.repeat(1, len(self.shards))
        return self.matmul.linear(xa, self.b, None, self.out_features)

    def write(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The slot's A [r, in] and scaled B [out, r] for each shard it adapts (the others cleared), rounded
        through the adapters' dtype where one is set."""
        assert self.a is not None and self.b is not None, "reset() after loading"
        rank = self.dims.max_rank
        for shard, out in enumerate(self.shards):
            first = (shard * self.dims.max_loras + slot) * rank
            cols = slice(first, first + rank)
            rows = slice(self.offsets[shard], self.offsets[shard] + out)
            self.raw_a[cols] = 0
            self.raw_b[rows, cols] = 0
            if shard in weights:
                a, b = (t.to(self.dims.dtype or t.dtype) for t in weights[shard])
                self.raw_a[cols][: a.shape[0]] = a
                self.raw_b[rows, cols][:, : b.shape[1]] = b
        self.a.data.copy_(self.matmul.pack(self.raw_a))
        self.b.data.copy_(self.matmul.pack(self.raw_b))


def slot_mask(slots: torch.Tensor, dims: LoraDims, dtype: torch.dtype) -> torch.Tensor:
    """Each token's slot (-1: none) -> the mask LoraStack.forward takes."""
    column_slot = torch.arange(dims.width, device=slots.device) // dims.max_rank
    return (slots[:, None] == column_slot).to(dtype)
