"""The backend: which implementation runs each op, chosen once from the config and the device
(`choose_backend`), then handed to the model, the runner and the sampler as they are built. The torch
references run anywhere; Triton kernels and FlashInfer run on CUDA. `auto` takes the CUDA ones where the
device is CUDA and they import; nothing imports FlashInfer or Triton on a machine that picks torch."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.ops import activation, moe, norm, rotary, sampler
from kiln.ops.attention import TORCH_ATTENTION, AttentionHeads, AttentionImpl, table_width
from kiln.ops.sampler import Draw, Prepare

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Kernels:
    """The ops a decoder layer calls around attention; each Triton kernel has its reference's interface."""

    name: str
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    moe_experts: Callable[..., torch.Tensor]


TORCH_KERNELS = Kernels("torch", norm.rms_norm, rotary.apply_rotary, activation.silu_and_mul, moe.moe_experts)


def triton_kernels() -> Kernels:
    from kiln.ops.triton import activation as t_activation
    from kiln.ops.triton import moe as t_moe
    from kiln.ops.triton import norm as t_norm
    from kiln.ops.triton import rotary as t_rotary

    return Kernels(
        "triton", t_norm.rms_norm, t_rotary.apply_rotary, t_activation.silu_and_mul, t_moe.moe_experts
    )


@dataclass(frozen=True, slots=True)
class Backend:
    kernels: str  # "torch" | "triton": the ops a layer calls around attention, and the sampler's prepare
    attention: str  # "torch" | "flashinfer"
    sampler: str  # "torch" | "flashinfer": the sampler's draw

    def layer_kernels(self) -> Kernels:
        return triton_kernels() if self.kernels == "triton" else TORCH_KERNELS

    def make_attention(
        self, heads: AttentionHeads, block_size: int, max_model_len: int, dtype: torch.dtype,
        device: torch.device,
    ) -> AttentionImpl:  # fmt: skip
        if self.attention != "flashinfer":
            return TORCH_ATTENTION
        from kiln.ops.flashinfer_attention import FlashInferAttention

        h = heads
        return FlashInferAttention(
            h.num_heads, h.num_kv_heads, h.head_dim, block_size, dtype, device,
            table_width(max_model_len, block_size), h.head_dim**-0.5, h.sliding_window,
        )  # fmt: skip

    def sampler_ops(self) -> tuple[Prepare, Draw]:
        """The sampler's prepare step (penalties, bias, temperature) and its draw."""
        prepare: Prepare = sampler.prepare_logits
        draw: Draw = sampler.draw_tokens
        if self.kernels == "triton":
            from kiln.ops.triton.sampling import prepare_logits as prepare
        if self.sampler == "flashinfer":
            from kiln.ops.flashinfer_sampling import draw_tokens as draw
        return prepare, draw


TORCH_BACKEND = Backend("torch", "torch", "torch")


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# What FlashInfer 0.5.3's paged kernels dispatch (its DISPATCH_HEAD_DIM; merge states fail on others).
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_unsupported(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why FlashInfer's attention can't serve this model, or None when it can."""
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"head_dim {head_dim} (FlashInfer serves {', '.join(map(str, FLASHINFER_HEAD_DIMS))})"
    if dtype not in FLASHINFER_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')} (FlashInfer serves float16 and bfloat16)"
    return None


def choose_backend(
    kernels: str, attention: str, sampler: str, device: torch.device, head_dim: int, dtype: torch.dtype
) -> Backend:
    """Resolves `auto` and checks explicit choices against the device and the model. Triton on a CPU is
    allowed only under TRITON_INTERPRET=1 (how its kernels are tested without a GPU)."""
    cuda = device.type == "cuda"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    has_triton, has_flashinfer = _importable("triton"), cuda and _importable("flashinfer")

    def pick(key: str, value: str, fast: str, available: bool, runs_here: bool) -> str:
        if value == "auto":
            return fast if cuda and available else "torch"
        if value == fast and not runs_here:
            raise ValueError(f"backend.{key} {fast!r} needs a CUDA device (model.device is {device.type!r})")
        if value == fast and not available:
            raise ValueError(f"backend.{key} {fast!r} is not installed: pip install 'kiln[cuda]'")
        return value

    unsupported = flashinfer_unsupported(head_dim, dtype)
    if attention == "flashinfer" and cuda and unsupported:
        raise ValueError(f"backend.attention 'flashinfer' cannot serve this model's {unsupported}")
    choice = Backend(
        kernels=pick("kernels", kernels, "triton", has_triton, cuda or interpret),
        attention=pick("attention", attention, "flashinfer", has_flashinfer and not unsupported, cuda),
        sampler=pick("sampler", sampler, "flashinfer", has_flashinfer, cuda),
    )
    if cuda and not has_flashinfer and "auto" in (attention, sampler):
        log.warning("FlashInfer is not installed: attention and sampling use the torch references (slower)")
    elif cuda and attention == "auto" and unsupported:
        log.warning(
            "attention uses the torch reference: FlashInfer cannot serve this model's %s", unsupported
        )
    return choice
