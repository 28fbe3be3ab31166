"""MoE experts through kiln's C++ linear kernels, on CpuMatmul's packing (pack_experts). The kernels are
batch-invariant, and so is the grouping, so a token's result never depends on the step's other tokens;
torch's GEMM picks its blocking by the rows an expert gets, which the rest of the batch decides."""

import torch

from kiln.ops import moe
from kiln.ops.activation import silu_and_mul
from kiln.ops.matmul import CpuMatmul
from kiln.ops.moe import grouped


@torch.library.custom_op("kiln::cpu_moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, amx: bool
) -> torch.Tensor:
    """kiln.ops.moe.moe_experts on packed experts: w13 [E, *gate_up's packing], w2 [E, *linear's]."""
    matmul, n, hidden = CpuMatmul(amx=amx), CpuMatmul.experts_width(w2[0]), x.shape[1]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return matmul.linear(matmul.gate_up(rows, w13[e], None, n, silu_and_mul), w2[e], None, hidden)

    return grouped(x, weights, ids, w13.shape[0], expert)


@moe_experts.register_fake
def _(x, w13, w2, weights, ids, amx):
    return torch.empty_like(x)


@torch.library.custom_op("kiln::cpu_route", mutates_args=())
def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """kiln.ops.moe.route, opaque to Inductor: torch's own softmax, top-k and sum compute a row the same way
    whatever the rows around it. Inductor's code for the one-row decode graph and for the many-row graph
    can round a token's routing weights differently (an AVX2 CPU moved Mixtral's logprobs by a bit with the
    batch)."""
    return moe.route(router_logits, top_k, renormalize)


@route.register_fake
def _(router_logits, top_k, renormalize):
    rows = router_logits.shape[0]
    weights = router_logits.new_empty(rows, top_k, dtype=torch.float32)
    return weights, router_logits.new_empty(rows, top_k, dtype=torch.int64)
