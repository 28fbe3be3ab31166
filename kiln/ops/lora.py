"""LoRA adapters in the model: each adapted linear layer holds every slot's A and B stacked, and a step
adds x A^T B^T for each token's slot as two dense matmuls under a mask, so the graphs keep one shape
whichever adapters a step mixes (vLLM's punica kernels gather per token instead; at a few slots of rank 16
the dense form costs a few percent of the layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class LoraDims:
    max_loras: int  # slots: the most adapters one step runs
    max_rank: int  # each slot's rank; a smaller adapter is padded with zeros
    dtype: torch.dtype | None = None  # the slots' (None: the activations')

    @property
    def width(self) -> int:
        return self.max_loras * self.max_rank


class LoraStack(nn.Module):
    """A linear layer's adapters, for its shards (q, k, v of a fused projection: each its own adapter).
    a: [shards * slots * rank, in], rows of shard s, slot j at (s * slots + j) * rank; b: [out, shards *
    slots * rank], block-diagonal over the shards, each B scaled by its adapter's alpha / r."""

    def __init__(self, dims: LoraDims, in_features: int, shards: list[int]) -> None:
        super().__init__()
        self.dims, self.shards = dims, shards
        self.offsets = [sum(shards[:s]) for s in range(len(shards))]
        cols = len(shards) * dims.width
        self.a = nn.Parameter(torch.empty(cols, in_features), requires_grad=False)
        self.b = nn.Parameter(torch.empty(sum(shards), cols), requires_grad=False)

    @classmethod
    def of(cls, dims: LoraDims | None, in_features: int, shards: list[int]) -> LoraStack | None:
        return None if dims is None else cls(dims, in_features, shards)

    def reset(self, dtype: torch.dtype) -> None:
        """Empty slots, in the activations' dtype (after loading, as the base weights are packed)."""
        self.a = nn.Parameter(torch.zeros_like(self.a, dtype=dtype), requires_grad=False)
        self.b = nn.Parameter(torch.zeros_like(self.b, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """mask [tokens, slots * rank]: 1 on the columns of each token's slot, 0 elsewhere (no adapter)."""
        xa = F.linear(x.to(self.a.dtype), self.a) * mask.repeat(1, len(self.shards))
        return F.linear(xa, self.b).to(x.dtype)

    def write(self, slot: int, shard: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """One shard's A [r, in] and scaled B [out, r] into the slot; None clears it."""
        rank, out = self.dims.max_rank, self.shards[shard]
        first = (shard * self.dims.max_loras + slot) * rank
        cols = slice(first, first + rank)
        rows = slice(self.offsets[shard], self.offsets[shard] + out)
        self.a[cols] = 0
        self.b[rows, cols] = 0
        if a is not None and b is not None:
            r = a.shape[0]
            self.a[cols][:r] = a
            self.b[rows, cols][:, :r] = b


def slot_mask(slots: torch.Tensor, dims: LoraDims, dtype: torch.dtype) -> torch.Tensor:
    """Each token's slot (-1: none) -> the mask LoraStack.forward takes."""
    column_slot = torch.arange(dims.width, device=slots.device) // dims.max_rank
    return (slots[:, None] == column_slot).to(dtype)
