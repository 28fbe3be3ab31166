"""How the lowering calls the compiled layer stack: in equal groups of consecutive layers (group_size),
each group one call of a compiled `run_layers`, whose trace marks the step-dependent dims dynamic
(mark_step_dims)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.models.decoder import DecoderLayer


def group_size(num_layers: int, calls: int = 5) -> int:
    """Layers per compiled call on the CPU: the smallest divisor of num_layers that makes at most `calls`
    calls a step, so every group has one size (and, for one kind of layer, one graph)."""
    return next(g for g in range(-(-num_layers // calls), num_layers + 1) if num_layers % g == 0)


class LayerGroups:
    """Runs the layer stack as consecutive groups of `size` layers, one compiled call per group: each
    group's own step (groups of different layers have different graphs)."""

    def __init__(self, steps: Sequence[Callable[..., Any]], size: int) -> None:
        self.steps, self.size = steps, size

    def __call__(
        self, layers: tuple[torch.nn.Module, ...], x: torch.Tensor, residual: torch.Tensor,
        positions: torch.Tensor, cos_sin: torch.Tensor | None, kv_caches: tuple[torch.Tensor, ...], meta: Any,
        lora_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        n = self.size
        for step, i in zip(self.steps, range(0, len(layers), n), strict=True):
            kv = kv_caches[i : i + n]
            x, residual = step(layers[i : i + n], x, residual, positions, cos_sin, kv, meta, lora_mask)
        return x, residual


def kind_suffixes(layers: torch.nn.ModuleList, size: int) -> list[str]:
    """For each group of `size` layers, the suffix naming its kind of group: "" where every group is alike,
    else ".<k>". Groups whose modules differ (a MoE layer and a dense one) trace different graphs."""
    groups = [
        tuple(
            f"{name}:{type(m).__name__}"
            for layer in layers[i : i + size]
            for name, m in layer.named_modules()
        )
        for i in range(0, len(layers), size)
    ]
    kinds = {g: k for k, g in enumerate(dict.fromkeys(groups))}
    return [""] * len(groups) if len(kinds) == 1 else [f".{kinds[g]}" for g in groups]


def _step_marks() -> list[tuple[int, str | None, int]]:
    """(argument after the layers, its field or None, dim) for each of DecoderLayer.STEP_DIMS, by forward's
    parameter names, which run_layers shares."""
    names = list(inspect.signature(DecoderLayer.forward).parameters)[1:]  # after self
    marks = []
    for name, dims in DecoderLayer.STEP_DIMS.items():
        fields = dims.items() if isinstance(dims, dict) else [(None, dims)]
        marks += [(names.index(name), f, dim) for f, f_dims in fields for dim in f_dims]
    return marks


_MARKS = _step_marks()
_KV_CACHES = list(inspect.signature(DecoderLayer.forward).parameters).index("kv_cache") - 1


def mark_step_dims(args: tuple[Any, ...]) -> None:
    """Marks the step-dependent dims of the layer step's arguments (after the layers) dynamic, for the
    trace, and the KV caches' blocks, whose number the memory left decides at each start: one graph serves
    any cache size. Leaving every dim dynamic (dynamic=True) also made the weights' dims symbolic, and
    tracing spent most of its time on them."""
    for index, field, dim in _MARKS:
        value = args[index] if field is None else getattr(args[index], field)
        if value is not None:  # a model without LoRA slots has no mask
            torch._dynamo.maybe_mark_dynamic(value, dim)
    for cache in args[_KV_CACHES]:
        torch._dynamo.maybe_mark_dynamic(cache, 0)
