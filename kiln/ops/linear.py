import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b. When `compute_dtype` is set, the weights stay in their (smaller) storage dtype
    and each call multiplies in compute_dtype, returning the input's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is None:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 1:
            # One row is a GEMV: torch's reduced-precision GEMV reads the weights once in their own dtype,
            # at about twice fp32's speed, where upcasting first would add a copy (measured in BENCHMARKS.md).
            w = self.weight
            return F.linear(x.to(w.dtype), w, self.bias).to(x.dtype)
        dt = self.compute_dtype
        bias = None if self.bias is None else self.bias.to(dt)
        return F.linear(x.to(dt), self.weight.to(dt), bias).to(x.dtype)
