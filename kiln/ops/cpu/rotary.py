"""RoPE through kiln's C++ kernel: float32 q and k in the neox layout, tokens split across threads once a
step has enough of them. Inductor's loop for it ran on one thread in the graph that serves prefills (it is
traced at a decode's size), 7-10% of a 2,048-token step's layer time (BENCHMARKS.md, sixteenth steps)."""

import torch

from kiln.ops import rotary


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """kiln.ops.rotary.apply_rotary, bit for bit; the reference serves the layouts the kernel does not."""
    if not neox or q.dtype != torch.float32 or k.dtype != torch.float32 or cos_sin.dtype != torch.float32:
        return rotary.apply_rotary(positions, q, k, cos_sin, neox)
    return torch.ops.kiln_cpu.rotary(positions, q, k, cos_sin)
