import math

import torch


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for a rope config (transformers' formulas)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise NotImplementedError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3)")


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int, attention_scaling: float) -> torch.Tensor:
    """[max_positions, rot_dim] table: cos in the first half, sin in the second."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, KVH, D] at `positions`; only the first rot_dim of D rotate.

    neox: halves layout (x1 = first half, x2 = second half), as transformers' rotate_half.
    Otherwise GPT-J's interleaved layout (pairs of adjacent elements)."""
    cos, sin = cos_sin[positions].unsqueeze(1).float().chunk(2, dim=-1)
    return _rotate(q, cos, sin, neox), _rotate(k, cos, sin, neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    xr, xpass = x[..., :rot_dim].float(), x[..., rot_dim:]
    if neox:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), xpass], dim=-1)
