"""The structured-output token mask and the greedy argmax through kiln's C++ kernels. xgrammar's CPU mask
kernel tests one bit at a time (1.6 ms for 16 rows of SmolLM2's 49,152 tokens, about a tenth of a decode
step at concurrency 16); kiln's blends eight tokens per AVX2 op and skips words that allow all 32. torch's
argmax took 2.4 ms a step at batch 64 (BENCHMARKS.md); kiln's compares eight lanes at a time."""

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    torch.ops.kiln_cpu.apply_bitmask(logits, bitmask, rows)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.ops.kiln_cpu.argmax(logits)
