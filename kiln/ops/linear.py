import torch
from torch import nn

from kiln.ops.lora import LoraStack
from kiln.ops.matmul import Activation, Matmul


class Linear(nn.Module):
    """y = x W^T + b, multiplied by the backend's Matmul, plus each token's LoRA adapter where the model
    serves them. `weight` is loaded as [out, in]; the model's prepare() then puts it in the Matmul's
    layout."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, matmul: Matmul, lora: LoraStack | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.matmul = out_features, matmul
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.lora = lora

    def pack(self) -> None:
        self.weight = nn.Parameter(self.matmul.pack(self.weight.data), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.matmul.pack_bias(self.bias.data), requires_grad=False)

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.matmul.linear(x, self.weight, self.bias, self.out_features)
        return y if self.lora is None or lora_mask is None else y + self.lora(x, lora_mask)


class GateUp(Linear):
    """A gated MLP's up projection: act(x [W_gate | W_up]^T + b) -> [M, n], where act is the backend's
    silu(gate) * up; one kernel where the Matmul fuses them (not with adapters, which add to gate and up
    before act). `weight` is loaded as [2n, in]."""

    def __init__(
        self, in_features: int, n: int, bias: bool, matmul: Matmul, act: Activation, lora: LoraStack | None
    ) -> None:
        super().__init__(in_features, 2 * n, bias, matmul, lora)
        self.n, self.act = n, act

    def pack(self) -> None:
        if self.lora is not None:
            return super().pack()
        bias = None if self.bias is None else self.bias.data
        weight, bias = self.matmul.pack_gate_up(self.weight.data, bias)
        self.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.lora is None:
            return self.matmul.gate_up(x, self.weight, self.bias, self.n, self.act)
        return self.act(super().forward(x, lora_mask))
