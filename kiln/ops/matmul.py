"""How linear layers and the LM head multiply: each implementation owns its weights' layout, applied once
after loading (`pack`), so no step converts a weight.

- TorchMatmul: torch's GEMM on the weights as loaded; a storage dtype the device can't multiply natively
  is widened once at load (the CPU fallback without kiln's kernels).
- CpuMatmul: kiln's C++ kernel on weights packed in their own dtype, widened in registers (or, bfloat16 on
  a CPU with AVX512-BF16, multiplied in bfloat16 pairs); batch-invariant (a row's result never depends on
  the other rows) and faster than torch's fp32 GEMM at every batch size on the 2-core AVX2 machine
  (BENCHMARKS.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

BLOCK = 16  # CpuMatmul's packed columns per block (vec.h's kBlock)
Activation = Callable[[torch.Tensor], torch.Tensor]


class Matmul(Protocol):
    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] as loaded -> the layout `linear` and `logits` take."""
        ...

    def pack_bias(self, bias: torch.Tensor) -> torch.Tensor: ...

    def pack_head(self, head: torch.Tensor) -> torch.Tensor:
        """The LM head [vocab, K] -> the layout `logits` takes."""
        ...

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        """x [M, K] -> [M, n] in x's dtype."""
        ...

    def logits(self, hidden: torch.Tensor, head: torch.Tensor, n: int) -> torch.Tensor:
        """hidden [M, K] -> float32 [M, n]."""
        ...

    def pack_gate_up(
        self, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A gated MLP's [2n, K] (gate's rows, then up's) and its bias -> the layout `gate_up` takes."""
        ...

    def gate_up(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, act: Activation
    ) -> torch.Tensor:
        """act(x W^T + b) -> [M, n], act being the backend's silu(gate) * up."""
        ...

    def pack_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A MoE layer's experts, w13 [E, 2n, K] (each one's gate rows, then up's) and w2 [E, K, n] -> the
        layout the backend's experts op takes."""
        ...


class SeparateGateUp:
    """gate_up as two kernels: the linear layer's [gate | up], then act on it."""

    def pack_gate_up(
        self: Matmul, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.pack(weight), None if bias is None else self.pack_bias(bias)

    def gate_up(
        self: Matmul,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        act: Activation,
    ) -> torch.Tensor:
        return act(self.linear(x, weight, bias, 2 * n))


class TorchMatmul(SeparateGateUp):
    def __init__(self, storage: torch.dtype | None = None) -> None:
        self.storage = storage  # set: weights are widened to it at load

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self.storage is None else weight.to(self.storage)

    def pack_bias(self, bias: torch.Tensor) -> torch.Tensor:
        return self.pack(bias)

    def pack_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pack(w13), self.pack(w2)

    def pack_head(self, head: torch.Tensor) -> torch.Tensor:
        # A CPU has no 16-bit GEMM into float32: the head gets a float32 copy.
        return head if head.dtype == torch.float32 or head.device.type != "cpu" else head.float()

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def logits(self, hidden: torch.Tensor, head: torch.Tensor, n: int) -> torch.Tensor:
        if head.dtype == torch.float32:
            return F.linear(hidden.float(), head)
        # cuBLAS accumulates a 16-bit head straight into float32: one read of the head per step.
        return torch.mm(hidden.to(head.dtype), head.t(), out_dtype=torch.float32)


class CpuMatmul(SeparateGateUp):
    """Needs kiln.ops.cpu.native loaded (the backend choice does it). Activations are float32.

    bf16_dot (a CPU with AVX512-BF16, native.bf16_dot()): bfloat16 weights are packed in pairs of k, and
    the kernel rounds x to bfloat16 and multiplies pairs with one dot-product instruction, accumulating in
    float32: twice the multiplies of widening, the way torch's own bfloat16 GEMM runs on such a CPU."""

    def __init__(self, bf16_dot: bool = False, amx: bool = False) -> None:
        self.bf16_dot, self.amx = bf16_dot, amx

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [ceil(N / 16), K, 16]: sixteen columns side by side, zero past N; or, bfloat16 weights
        with bf16_dot, [ceil(N / 16), 16 * ceil(K / 32), 16, 2]: each column's pairs of k, zero past K too."""
        n, k = weight.shape
        blocks = -(-n // BLOCK)
        pairs = self.bf16_dot and weight.dtype == torch.bfloat16
        width = -(-k // 32) * 32 if pairs else k  # whole AMX tiles of 16 pairs
        padded = torch.zeros(blocks * BLOCK, width, dtype=weight.dtype, device=weight.device)
        padded[:n, :k] = weight
        if pairs:
            return padded.view(blocks, BLOCK, width // 2, 2).transpose(1, 2).contiguous()
        return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()

    def pack_bias(self, bias: torch.Tensor) -> torch.Tensor:
        return bias.float()

    def pack_head(self, head: torch.Tensor) -> torch.Tensor:
        return self.pack(head)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        return torch.ops.kiln_cpu.linear(self._rounded(x, weight), weight, n, bias)

    def logits(self, hidden: torch.Tensor, head: torch.Tensor, n: int) -> torch.Tensor:
        return self.linear(hidden.float(), head, None, n)

    def pack_gate_up(
        self, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On AMX, bfloat16: gate's and up's blocks of 16 columns interleaved, so one kernel's tiles hold a
        block of each and multiply them into silu(gate) * up (kiln_cpu::gate_up)."""
        n = weight.shape[0] // 2
        if not self._fuses(n, self.bf16_dot and weight.dtype == torch.bfloat16):
            return super().pack_gate_up(weight, bias)

        def interleave(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(2, n // BLOCK, BLOCK, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

        return self.pack(interleave(weight)), None if bias is None else interleave(bias).float()

    def gate_up(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, act: Activation
    ) -> torch.Tensor:
        if self._fuses(n, weight.dim() == 4):
            return torch.ops.kiln_cpu.gate_up(self._rounded(x, weight), weight, n, bias)
        return super().gate_up(x, weight, bias, n, act)

    def pack_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert packed as gate_up's and linear's weights, stacked. With pairs, the width n is padded
        with zero rows (gate and up) and columns (w2) to whole tiles of 32, where the pairs pad K anyway:
        an expert's width is then what its packed w2 multiplies (experts_width), and the padding adds
        silu(0) * 0 = 0 terms."""
        n = w2.shape[2]
        if self.bf16_dot and w2.dtype == torch.bfloat16:
            wide = -(-n // 32) * 32
            w13 = F.pad(w13.view(w13.shape[0], 2, n, -1), (0, 0, 0, wide - n)).flatten(1, 2)
            w2 = F.pad(w2, (0, wide - n))
        return (
            torch.stack([self.pack_gate_up(w, None)[0] for w in w13]),
            torch.stack([self.pack(w) for w in w2]),
        )

    @staticmethod
    def experts_width(w2: torch.Tensor) -> int:
        """An expert's width n from its packed w2 [N-blocks, K, 16] or, in pairs, [N-blocks, K / 2, 16, 2]."""
        return w2.shape[1] * (2 if w2.dim() == 4 else 1)

    def _fuses(self, n: int, pairs: bool) -> bool:
        """Whether gate_up is one kernel for pair-packed weights of width n (its bfloat16 output is then the
        down projection's own pairs, which needs n whole tiles of 32)."""
        return self.amx and pairs and n % 32 == 0

    @staticmethod
    def _rounded(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Pair-packed weights multiply x rounded to bfloat16, whose rows are their own pairs where K is
        whole tiles of 32: rounded here, Inductor fuses the rounding into the kernel that makes x, and
        the float32 x is neither written nor read again (the kernel would round a copy itself)."""
        if weight.dim() == 4 and x.shape[-1] % 32 == 0:
            return x.to(torch.bfloat16)
        return x
