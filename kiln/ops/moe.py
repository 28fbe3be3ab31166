from collections.abc import Callable

import torch

from kiln.ops.activation import silu_and_mul


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, keep the top k, optionally renormalise them to sum to 1.
    Returns (weights [T, k] fp32, expert ids [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """x [T, H] through its tokens' top-k experts, weights/ids [T, k] -> [T, H]. Tokens are sorted by expert,
    so each expert runs one GEMM over a contiguous slice (a grouped GEMM): expert(e, rows) -> [rows, H].
    On a CPU, index_add_ adds a token's k results in expert order, whatever else the step holds."""
    top_k = ids.shape[1]
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    xs = x[token_of]
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = expert(e, xs[start : start + n])
        start += n
    scaled = out * weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, scaled)


@torch.library.custom_op("kiln::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Gated-SiLU experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k] -> [T, H]; opaque to
    torch.compile, as the grouping depends on the data."""
    return grouped(x, weights, ids, w13.shape[0], lambda e, rows: silu_and_mul(rows @ w13[e].t()) @ w2[e].t())


@moe_experts.register_fake
def _(x, w13, w2, weights, ids):
    return torch.empty_like(x)
