"""Host-to-device copies that never hold the host. `torch.tensor(data, device=cuda)` and a blocking
`.to(cuda)` synchronize the stream: the host would wait for every step queued before the copy, and async
scheduling's overlap of one step's host work with the last step's GPU work would be gone. From pinned memory
a copy is queued like a kernel, and torch's host allocator keeps the pinned block until the copy has run."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def pinned(data: Sequence | np.ndarray | torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """data as a host tensor in pinned memory (a CUDA machine's; the copy's source for to_device)."""
    return _host(data, dtype).pin_memory()


def to_device(
    data: Sequence | np.ndarray | torch.Tensor, dtype: torch.dtype | None, device: torch.device
) -> torch.Tensor:
    """data as a tensor on device, queued without a sync where the device is a GPU. On the CPU a numpy
    array's tensor shares its memory."""
    if device.type == "cpu":
        return _host(data, dtype)
    return pinned(data, dtype).to(device, non_blocking=True)


def _host(data: Sequence | np.ndarray | torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data, dtype=dtype)
