"""The backend: which implementation runs each op, chosen once from the config and the device
(`choose_backend`), then handed to the model, the runner and the sampler as they are built. The torch
references run anywhere; Triton kernels and FlashInfer run on CUDA; kiln's C++ kernels (linear layers and
paged attention, batch-invariant) run on x86 CPUs with AVX2 and a C++ compiler. `auto` takes the fastest
that runs here; nothing imports FlashInfer or Triton on a machine that picks torch."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.ops import activation, moe, norm, rotary, sampler
from kiln.ops.attention import AttentionHeads, AttentionImpl, table_width
from kiln.ops.cpu import native as cpu_native
from kiln.ops.matmul import CpuMatmul, Matmul, TorchMatmul
from kiln.ops.sampler import Argmax, Draw, Mask, Prepare
from kiln.ops.torch_attention import TORCH_ATTENTION
from kiln.platform import native_matmul_dtypes

log = logging.getLogger(__name__)

TORCH_MATMUL = TorchMatmul()


@dataclass(frozen=True, slots=True)
class Kernels:
    """The ops a decoder layer calls around attention; each Triton kernel has its reference's interface."""

    name: str
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    moe_experts: Callable[..., torch.Tensor]
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]] = moe.route  # a MoE layer's expert choice
    matmul: Matmul = TORCH_MATMUL
    activations: torch.dtype | None = None  # the residual stream's dtype; None: the weights'


TORCH_KERNELS = Kernels("torch", norm.rms_norm, rotary.apply_rotary, activation.silu_and_mul, moe.moe_experts)


def torch_kernels(device: torch.device, dtype: torch.dtype) -> Kernels:
    """The torch references for weights of `dtype` on `device`: where the device has no native GEMM for
    that dtype, weights are widened to float32 once at load, and so is the residual stream."""
    if dtype in native_matmul_dtypes(device):
        return TORCH_KERNELS
    return dataclasses.replace(TORCH_KERNELS, matmul=TorchMatmul(torch.float32), activations=torch.float32)


def triton_kernels(deterministic: bool = False) -> Kernels:
    """deterministic: linear layers and the LM head run Triton's batch-invariant GEMM instead of cuBLAS,
    whose kernel (split-K included) depends on the batch's row count; MoE experts, one row tile."""
    from kiln.ops.triton import activation as t_activation
    from kiln.ops.triton import moe as t_moe
    from kiln.ops.triton import norm as t_norm
    from kiln.ops.triton import rotary as t_rotary

    kernels = Kernels(
        "triton", t_norm.rms_norm, t_rotary.apply_rotary, t_activation.silu_and_mul, t_moe.moe_experts
    )
    if not deterministic:
        return kernels
    from kiln.ops.triton.matmul import TritonMatmul

    experts = functools.partial(t_moe.moe_experts, deterministic=True)
    return dataclasses.replace(kernels, matmul=TritonMatmul(), moe_experts=experts)


@dataclass(frozen=True, slots=True)
class Backend:
    kernels: str  # "torch" | "triton" | "cpu": a layer's ops around attention, and the sampler's prepare
    attention: str  # "torch" | "flashinfer" | "cpu"
    sampler: str  # "torch" | "flashinfer": the sampler's draw
    deterministic: bool = False  # batch-invariant kernels (the CPU's are regardless)

    def layer_kernels(self, device: torch.device, dtype: torch.dtype) -> Kernels:
        if self.kernels == "triton":
            return triton_kernels(self.deterministic)
        if self.kernels == "cpu":
            # float32 activations: the kernels widen 16-bit weights in registers and accumulate in float32,
            # or multiply bfloat16 weights natively where the CPU can.
            from kiln.ops.cpu.moe import moe_experts, route
            from kiln.ops.cpu.rotary import apply_rotary as rope

            cpu = CpuMatmul(bf16_dot=cpu_native.bf16_dot(), amx=cpu_native.amx())
            experts = functools.partial(moe_experts, amx=cpu.amx)
            return dataclasses.replace(
                TORCH_KERNELS, name="cpu", apply_rotary=rope, moe_experts=experts, route=route, matmul=cpu,
                activations=torch.float32,
            )  # fmt: skip
        return torch_kernels(device, dtype)

    def tiles(self, dtype: torch.dtype) -> bool:
        """Whether a model of this dtype multiplies on AMX tiles: bfloat16 through the CPU kernels, on a CPU
        that has them."""
        return self.kernels == "cpu" and dtype == torch.bfloat16 and cpu_native.amx()

    def make_attention(
        self, heads: AttentionHeads, block_size: int, max_model_len: int, max_graph_batch: int,
        dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
    ) -> AttentionImpl:  # fmt: skip
        """max_graph_batch: the largest decode batch a CUDA graph may capture. dtype: the queries'; kv_dtype:
        what the KV cache stores."""
        if self.attention == "cpu":
            from kiln.ops.cpu.attention import CpuAttention, pair_layout

            if block_size % 8:
                raise ValueError(
                    f"cache.block_size {block_size}: kiln's CPU attention reads keys 8 at a time, so it "
                    "needs a multiple of 8 (or backend.attention: torch)"
                )
            return CpuAttention(pair_layout(kv_dtype, heads.head_dim))
        if self.attention != "flashinfer":
            return TORCH_ATTENTION
        from kiln.ops.flashinfer_attention import FlashInferAttention

        h = heads
        return FlashInferAttention(
            h.num_heads, h.num_kv_heads, h.head_dim, block_size, dtype, kv_dtype, device,
            table_width(max_model_len, block_size), h.head_dim**-0.5, h.sliding_window, max_graph_batch,
            self.deterministic,
        )  # fmt: skip

    def sampler_ops(self) -> tuple[Prepare, Draw, Mask, Argmax]:
        """The sampler's prepare step (penalties, bias, temperature), its draw, its grammar mask and its
        greedy argmax."""
        prepare: Prepare = sampler.prepare_logits
        draw: Draw = sampler.draw_tokens
        mask: Mask = sampler.apply_bitmask
        argmax: Argmax = sampler.argmax
        if self.kernels == "triton":
            from kiln.ops.triton.sampling import prepare_logits as prepare
        if self.kernels == "cpu":
            from kiln.ops.cpu.sampling import apply_bitmask as mask
            from kiln.ops.cpu.sampling import argmax
        if self.sampler == "flashinfer":
            from kiln.ops.flashinfer_sampling import draw_tokens as draw
        return prepare, draw, mask, argmax


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
    kernels: str, attention: str, sampler: str, device: torch.device, head_dim: int, dtype: torch.dtype,
    deterministic: bool = False,
) -> Backend:  # fmt: skip
    """Resolves `auto` and checks explicit choices against the device and the model. Triton on a CPU is
    allowed only under TRITON_INTERPRET=1 (how its kernels are tested without a GPU). kiln's CPU kernels
    are built on first use (seconds, once per machine); where they can't be, the CPU runs the torch
    references, which are neither as fast nor batch-invariant. `deterministic` refuses the torch
    references: on CUDA it needs the Triton kernels and FlashInfer, which it runs batch-invariant."""
    cuda = device.type == "cuda"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    has_triton, has_flashinfer = _importable("triton"), cuda and _importable("flashinfer")
    cpu_missing = None if cuda or not {kernels, attention} & {"cpu", "auto"} else cpu_native.available()

    def pick(key: str, value: str, fast: str, available: bool, runs_here: bool) -> str:
        if value == "auto":
            if not cuda and key != "sampler":
                return "cpu" if cpu_missing is None else "torch"
            return fast if cuda and available else "torch"
        if value == "cpu" and cuda:
            raise ValueError(f"backend.{key} 'cpu' runs on a CPU (model.device is {device.type!r})")
        if value == "cpu" and cpu_missing is not None:
            raise ValueError(f"backend.{key} 'cpu' cannot run here: {cpu_missing}")
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
        deterministic=deterministic,
    )
    if deterministic and "torch" in (choice.kernels, choice.attention):
        need = "the Triton kernels and FlashInfer attention" if cuda else "kiln's CPU kernels"
        missing = None if has_flashinfer else "FlashInfer is not installed: pip install 'kiln[cuda]'"
        why = (unsupported or missing) if cuda else cpu_missing
        raise ValueError(
            f"backend.deterministic needs {need}, but kernels is {choice.kernels!r} and attention "
            f"{choice.attention!r}: torch's reference ops may answer a request differently in another batch"
            + (f" ({why})" if why else "")
        )
    if deterministic and cuda:
        log.info("deterministic: Triton's batch-invariant GEMM; every step in FlashInfer's prefill kernel")
    if cuda and not has_flashinfer and "auto" in (attention, sampler):
        log.warning("FlashInfer is not installed: attention and sampling use the torch references (slower)")
    elif cuda and attention == "auto" and unsupported:
        log.warning(
            "attention uses the torch reference: FlashInfer cannot serve this model's %s", unsupported
        )
    elif not cuda and "torch" in (choice.kernels, choice.attention):
        log.warning(
            "the CPU runs torch's reference ops%s: slower, and a request's answer may depend on its batch",
            "" if cpu_missing is None else f" (kiln's CPU kernels cannot run here: {cpu_missing})",
        )
    return choice
