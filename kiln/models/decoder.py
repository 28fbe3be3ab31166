"""One generic decoder, built from an ArchSpec and its ModelDims. Read top to bottom: embed, layers, norm."""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.models.spec import ArchSpec, ModelDims
from kiln.ops.activation import ACTIVATIONS
from kiln.ops.attention import AttentionImpl, AttnMetadata
from kiln.ops.backend import TORCH_KERNELS, Kernels
from kiln.ops.linear import GateUp, Linear
from kiln.ops.lora import LoraDims, LoraStack, slot_mask
from kiln.ops.norm import layer_norm
from kiln.ops.rotary import rope_cos_sin, rope_inv_freq
from kiln.ops.torch_attention import TORCH_ATTENTION

log = logging.getLogger(__name__)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Norm(nn.Module):
    def __init__(self, kind: str, dim: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.kind, self.eps, self.kernels = kind, eps, kernels
        self.weight = _param(dim)
        self.bias = _param(dim) if kind == "layer" else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "rms":
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        return layer_norm(x, self.weight, self.bias, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, d: ModelDims, kernels: Kernels, impl: AttentionImpl, lora: LoraDims | None) -> None:
        super().__init__()
        self.kernels, self.impl = kernels, impl
        self.num_heads, self.num_kv_heads, self.head_dim = d.num_heads, d.num_kv_heads, d.head_dim
        q, kv = self.q_size, self.kv_size = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        mm, h = kernels.matmul, d.hidden_size
        self.qkv = Linear(h, q + 2 * kv, d.qkv_bias, mm, LoraStack.of(lora, h, [q, kv, kv], mm))
        self.o = Linear(q, h, d.o_bias, mm, LoraStack.of(lora, q, [h], mm))
        self.q_norm = Norm("rms", d.head_dim, d.norm_eps, kernels) if d.qk_norm else None
        self.k_norm = Norm("rms", d.head_dim, d.norm_eps, kernels) if d.qk_norm else None
        self.scale = d.head_dim**-0.5
        self.sliding_window = d.sliding_window

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttnMetadata,
        lora_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, lora_mask).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        if cos_sin is not None:
            q, k = self.kernels.apply_rotary(positions, q, k, cos_sin)
        o = self.impl.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window)
        return self.o(o.flatten(1), lora_mask)


class GatedMLP(nn.Module):
    def __init__(self, d: ModelDims, kernels: Kernels, lora: LoraDims | None) -> None:
        super().__init__()
        mm, h, n = kernels.matmul, d.hidden_size, d.intermediate_size
        self.gate_up = GateUp(h, n, d.mlp_bias, mm, kernels.silu_and_mul, LoraStack.of(lora, h, [n, n], mm))
        self.down = Linear(n, h, d.mlp_bias, mm, LoraStack.of(lora, n, [h], mm))

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None) -> torch.Tensor:
        return self.down(self.gate_up(x, lora_mask), lora_mask)


class PlainMLP(nn.Module):
    def __init__(self, d: ModelDims, kernels: Kernels, lora: LoraDims | None) -> None:
        super().__init__()
        mm, h, n = kernels.matmul, d.hidden_size, d.intermediate_size
        self.fc = Linear(h, n, d.mlp_bias, mm, LoraStack.of(lora, h, [n], mm))
        self.proj = Linear(n, h, d.mlp_bias, mm, LoraStack.of(lora, n, [h], mm))
        self.act = ACTIVATIONS[d.hidden_act]

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None) -> torch.Tensor:
        return self.proj(self.act(self.fc(x, lora_mask)), lora_mask)


class MoE(nn.Module):
    """Experts take no adapters (an adapter for them is refused when it loads); the router neither."""

    def __init__(self, d: ModelDims, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.top_k, self.renormalize = d.experts_per_token, d.moe_renormalize
        self.router = Linear(d.hidden_size, d.num_experts, False, kernels.matmul)
        self.w13 = _param(d.num_experts, 2 * d.moe_intermediate_size, d.hidden_size)
        self.w2 = _param(d.num_experts, d.hidden_size, d.moe_intermediate_size)

    def pack(self) -> None:
        w13, w2 = self.kernels.matmul.pack_experts(self.w13.data, self.w2.data)
        self.w13, self.w2 = (nn.Parameter(w, requires_grad=False) for w in (w13, w2))

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None) -> torch.Tensor:
        weights, ids = self.kernels.route(self.router(x), self.top_k, self.renormalize)
        return self.kernels.moe_experts(x, self.w13, self.w2, weights, ids)


class DecoderLayer(nn.Module):
    # forward's arguments whose dims change from step to step (the lowering compiles them dynamic).
    STEP_DIMS: ClassVar[dict[str, Any]] = {
        "x": (0,),
        "residual": (0,),
        "positions": (0,),
        "meta": AttnMetadata.STEP_DIMS,
        "lora_mask": (0,),
    }

    def __init__(
        self,
        spec: ArchSpec,
        d: ModelDims,
        index: int,
        kernels: Kernels,
        attention: AttentionImpl,
        lora: LoraDims | None,
    ) -> None:
        super().__init__()
        self.attn_norm = Norm(spec.norm, d.hidden_size, d.norm_eps, kernels)
        self.attn = Attention(d, kernels, attention, lora)
        self.mlp_norm = Norm(spec.norm, d.hidden_size, d.norm_eps, kernels)
        dense = GatedMLP if spec.mlp == "gated" else PlainMLP
        self.mlp = MoE(d, kernels) if d.is_moe_layer(index) else dense(d, kernels, lora)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttnMetadata,
        lora_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.attn_norm(x, residual)
        h = self.attn(h, positions, cos_sin, kv_cache, meta, lora_mask)
        h, residual = self.mlp_norm(h, residual)
        return self.mlp(h, lora_mask), residual


# Runs decoder layers in order: (layers, x, residual, positions, cos_sin, kv_caches, meta, lora_mask) ->
# (x, residual).
# run_layers below, or the lowering's compiled groups of layers.
RunLayers = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def run_layers(
    layers: Sequence[nn.Module],
    x: torch.Tensor,
    residual: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor | None,
    kv_caches: Sequence[torch.Tensor],
    meta: AttnMetadata,
    lora_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    for layer, kv_cache in zip(layers, kv_caches, strict=True):
        x, residual = layer(x, residual, positions, cos_sin, kv_cache, meta, lora_mask)
    return x, residual


@dataclass(frozen=True, slots=True)
class GivenEmbeds:
    """A step's rows whose input embedding is given (a prompt's prompt_embeds), not looked up by token id."""

    rows: torch.Tensor  # int64 [n]: positions in the step's flat batch
    values: torch.Tensor  # [n, hidden_size], in the embedding's dtype


class DecoderModel(nn.Module):
    def __init__(
        self,
        spec: ArchSpec,
        d: ModelDims,
        kernels: Kernels = TORCH_KERNELS,
        attention: AttentionImpl = TORCH_ATTENTION,
        lora: LoraDims | None = None,
    ) -> None:
        """lora: slots for LoRA adapters in every attention and dense MLP projection (None: served
        without)."""
        super().__init__()
        self.spec, self.dims, self.kernels, self.attention = spec, d, kernels, attention
        self.lora = lora
        self.embed = nn.Embedding(d.vocab_size, d.hidden_size)
        self.pos_embed = nn.Embedding(d.max_positions, d.hidden_size) if spec.positions == "learned" else None
        self.layers = nn.ModuleList(
            DecoderLayer(spec, d, i, kernels, attention, lora) for i in range(d.num_layers)
        )
        self.norm = Norm(spec.norm, d.hidden_size, d.norm_eps, kernels)
        head = None if d.tie_word_embeddings else Linear(d.hidden_size, d.vocab_size, False, kernels.matmul)
        self.lm_head = head
        self.score = _param(d.num_labels, d.hidden_size) if d.num_labels else None  # a classifier's head
        self.cos_sin: torch.Tensor | None = None
        self.logits_weight: torch.Tensor | None = None

    def prepare(self, max_positions: int) -> None:
        """After weights are loaded: the rotary table, and every weight in its Matmul's layout; the LM head
        too, as `logits_weight` (a tied head is a copy where the layout differs from the embedding's)."""
        d = self.dims
        device = self.embed.weight.device
        if self.spec.positions == "rope":
            inv_freq, scaling = rope_inv_freq(d.rotary_dim or d.head_dim, d.rope_theta, d.rope_scaling)
            self.cos_sin = rope_cos_sin(inv_freq, max_positions, scaling).to(device)
        for module in self.modules():
            if isinstance(module, Linear | MoE) and module is not self.lm_head:
                module.pack()
            if isinstance(module, LoraStack):
                module.reset(self.kernels.activations or self.embed.weight.dtype, device)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        self.logits_weight = self.kernels.matmul.pack_head(head)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttnMetadata,
        lora_slots: torch.Tensor | None = None,
        given: GivenEmbeds | None = None,
        run: RunLayers = run_layers,
    ) -> torch.Tensor:
        """lora_slots: each token's adapter slot (-1: none), where the model has slots. given: rows whose
        input is an embedding rather than a token's (outside the compiled layers: nothing to trace)."""
        x = self.embed(input_ids)
        if given is not None:
            x = x.index_copy(0, given.rows, given.values)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        if self.kernels.activations is not None:
            x = x.to(self.kernels.activations)
        # A zero residual rather than None, so every layer runs the same code and shares one compiled graph.
        residual = torch.zeros_like(x)
        layers = tuple(self.layers)
        mask = None
        if self.lora is not None:
            assert lora_slots is not None, "a model with LoRA slots takes each token's slot"
            mask = slot_mask(lora_slots, self.lora, x.dtype)
        x, residual = run(layers, x, residual, positions, self.cos_sin, tuple(kv_caches), meta, mask)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits for the rows of `hidden`."""
        w = self.logits_weight
        assert w is not None, "call prepare() after loading weights"
        return self.kernels.matmul.logits(hidden, w, self.dims.vocab_size)
