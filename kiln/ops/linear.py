import torch
from torch import nn

from kiln.ops.matmul import Activation, Matmul


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


class GateUp(Linear):
    """A gated MLP's up projection: act(x [W_gate | W_up]^T + b) -> [M, n], where act is the backend's
    silu(gate) * up; one kernel where the Matmul fuses them. `weight` is loaded as [2n, in]."""

    def __init__(self, in_features: int, n: int, bias: bool, matmul: Matmul, act: Activation) -> None:
        super().__init__(in_features, 2 * n, bias, matmul)
        self.n, self.act = n, act

    def pack(self) -> None:
        bias = None if self.bias is None else self.bias.data
        weight, bias = self.matmul.pack_gate_up(self.weight.data, bias)
        self.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul.gate_up(x, self.weight, self.bias, self.n, self.act)
