from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Shard = str | None  # which part of a packed parameter a checkpoint tensor fills: "q", "gate", ...


@dataclass(frozen=True, slots=True)
class WeightRule:
    """One checkpoint tensor name pattern -> one kiln parameter (or a shard of it).

    Patterns use {i} for the layer and {e} for the expert; `when` names a ModelDims flag that must hold."""

    source: str
    target: str
    shard: Shard = None
    when: str | None = None
    transpose: bool = False
    layers: Literal["all", "moe", "dense"] = "all"


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """An architecture as data: which parts the generic decoder uses, and how checkpoints map onto it."""

    name: str
    norm: Literal["rms", "layer"]
    positions: Literal["rope", "learned"]
    mlp: Literal["gated", "plain"]  # the dense MLP; MoE layers come from ModelDims
    rules: tuple[WeightRule, ...]
    dims: Callable[[Any], ModelDims]
    ignore: tuple[str, ...] = ()  # regexes of checkpoint tensors that carry no weights (buffers)
    strip_prefix: str = ""


@dataclass(frozen=True, slots=True)
class ModelDims:
    """Every number and switch the decoder needs, read from a transformers config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rotary_dim: int = 0  # 0: the whole head
    sliding_window: int = 0  # 0: off
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = True
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or dense MLP; empty: all dense
    num_labels: int = 0  # a sequence classifier's classes (its `score` head over the last token); 0: none

    @property
    def untied(self) -> bool:
        return not self.tie_word_embeddings

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]


def expand(rule: WeightRule, dims: ModelDims) -> list[tuple[str, str, Shard, int | None]]:
    """(checkpoint name, kiln parameter, shard, expert) for every tensor a rule covers."""
    out = []
    for i in range(dims.num_layers) if "{i}" in rule.source else [None]:
        if i is not None and rule.layers != "all" and dims.is_moe_layer(i) != (rule.layers == "moe"):
            continue
        for e in range(dims.num_experts) if "{e}" in rule.source else [None]:
            src = rule.source.replace("{i}", str(i)).replace("{e}", str(e))
            out.append((src, rule.target.replace("{i}", str(i)), rule.shard, e))
    return out


def rule_applies(rule: WeightRule, dims: ModelDims) -> bool:
    return rule.when is None or bool(getattr(dims, rule.when))


def ignored(name: str, spec: ArchSpec) -> bool:
    return any(re.fullmatch(p, name) for p in spec.ignore)
