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


@torch.library.custom_op("kiln::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Gated-SiLU experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k] -> [T, H].

    Tokens are sorted by expert so each expert runs one GEMM over a contiguous slice (a grouped GEMM);
    the data-dependent grouping is why this is an opaque op to torch.compile."""
    num_experts, top_k = w13.shape[0], ids.shape[1]
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    xs = x[token_of]
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            # Weights may be stored narrower than x (bf16 on a CPU without bf16 GEMMs): cast per expert.
            h = silu_and_mul(xs[start : start + n] @ w13[e].t().to(xs.dtype))
            out[start : start + n] = h @ w2[e].t().to(xs.dtype)
        start += n
    scaled = out * weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, scaled)


@moe_experts.register_fake
def _(x, w13, w2, weights, ids):
    return torch.empty_like(x)
