import torch
from torch import nn

from kiln.ops.matmul import Matmul


class Linear(nn.Module):
    """y = x W^T + b, multiplied by the backend's Matmul. `weight` is loaded as [out, in]; the model's
    prepare() then puts it in the Matmul's layout."""

    def __init__(self, in_features: int, out_features: int, bias: bool, matmul: Matmul) -> None:
        super().__init__()
        self.out_features, self.matmul = out_features, matmul
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def pack(self) -> None:
        self.weight = nn.Parameter(self.matmul.pack(self.weight.data), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.matmul.pack_bias(self.bias.data), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul.linear(x, self.weight, self.bias, self.out_features)
