"""Torch reference ops against transformers' implementations and naive loops."""

import numpy as np
import pytest
import torch
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rotary
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary

from kiln.ops.attention import StepLayout
from kiln.ops.moe import moe_experts, route
from kiln.ops.norm import rms_norm
from kiln.ops.rotary import apply_rotary, rope_cos_sin, rope_inv_freq
from kiln.ops.torch_attention import attention

torch.manual_seed(0)


def test_rotary_neox_layout_matches_llama() -> None:
    T, H, D = 7, 4, 16
    q, k = torch.randn(T, H, D), torch.randn(T, 2, D)
    positions = torch.tensor([0, 3, 5, 9, 10, 30, 31])
    inv_freq, scale = rope_inv_freq(D, 10000.0, None)
    ours = apply_rotary(positions, q, k, rope_cos_sin(inv_freq, 64, scale), neox=True)
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    ref_q, ref_k = llama_rotary(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    torch.testing.assert_close(ours[0], ref_q[0].transpose(0, 1))
    torch.testing.assert_close(ours[1], ref_k[0].transpose(0, 1))


def test_rotary_interleaved_layout_matches_gptj_with_partial_rotary_dim() -> None:
    T, H, D, rot = 5, 3, 16, 8
    q, k = torch.randn(T, H, D), torch.randn(T, H, D)
    positions = torch.tensor([1, 2, 7, 8, 40])
    inv_freq, scale = rope_inv_freq(rot, 10000.0, None)
    ours_q, ours_k = apply_rotary(positions, q, k, rope_cos_sin(inv_freq, 64, scale), neox=False)
    sincos = create_sinusoidal_positions(64, rot)[positions]
    sin, cos = (
        sincos[None, :, None, : rot // 2].transpose(1, 2),
        sincos[None, :, None, rot // 2 :].transpose(1, 2),
    )
    for ours, x in ((ours_q, q), (ours_k, k)):
        x4 = x[None]  # [1, T, H, D], gptj's layout
        ref_rot = gptj_rotary(x4[..., :rot], sin.transpose(1, 2)[:, :, 0], cos.transpose(1, 2)[:, :, 0])
        torch.testing.assert_close(ours[..., :rot], ref_rot[0])
        torch.testing.assert_close(ours[..., rot:], x[..., rot:])


def test_llama3_scaling_slows_low_frequencies_only() -> None:
    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    base, _ = rope_inv_freq(32, 10000.0, None)
    scaled, _ = rope_inv_freq(32, 10000.0, scaling)
    assert torch.equal(scaled[:2], base[:2])  # high frequencies untouched
    torch.testing.assert_close(scaled[-1], base[-1] / 8.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_matches_transformers(dtype: torch.dtype) -> None:
    hf = LlamaRMSNorm(32, eps=1e-5)
    hf.weight.data = torch.randn(32)
    hf = hf.to(dtype)
    x, residual = torch.randn(6, 32, dtype=dtype), torch.randn(6, 32, dtype=dtype)
    out, new_residual = rms_norm(x, hf.weight, 1e-5, residual)
    assert torch.equal(new_residual, x + residual)
    torch.testing.assert_close(out, hf(x + residual))


def test_moe_matches_per_token_loop() -> None:
    T, H, inter, E, top_k = 9, 16, 24, 5, 2
    x, router = torch.randn(T, H), torch.randn(T, E)
    w13, w2 = torch.randn(E, 2 * inter, H) * 0.1, torch.randn(E, H, inter) * 0.1
    weights, ids = route(router, top_k, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(T))
    expected = torch.zeros(T, H)
    for t in range(T):
        for j in range(top_k):
            e = ids[t, j]
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe_experts(x, w13, w2, weights, ids), expected, rtol=1e-5, atol=1e-5)


def _naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions over k/v [L, KVH, D], head by head."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty_like(q)
    for i in range(n):
        pos = k.shape[0] - n + i
        for h in range(num_heads):
            scores = (k[: pos + 1, h // group] @ q[i, h]) * scale
            out[i, h] = scores.softmax(0) @ v[: pos + 1, h // group]
    return out


def test_paged_attention_mixed_batch_on_cached_prefix() -> None:
    """Two decodes and a prefill chunk sitting on a 21-token cached prefix, in scattered blocks,
    plus a padding row whose slot is -1 and must write nothing outside the padding block (the last one)."""
    H, KVH, D, bs, num_blocks = 4, 2, 8, 4, 32
    cache = torch.randn(num_blocks + 1, 2, bs, KVH, D)
    contexts = [9, 14, 21 + 6]  # seq_lens after this step
    new = [1, 1, 6]
    tables = [torch.randperm(num_blocks)[: -(-c // bs)] for c in contexts]
    tables[1] = torch.tensor([b for b in range(num_blocks) if b not in set(tables[0].tolist())][:4])
    tables[2] = torch.tensor(
        [b for b in range(num_blocks) if b not in set(tables[0].tolist() + tables[1].tolist())][:7]
    )
    block_table = torch.zeros(3, 8, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, : len(t)] = t
    slots, rows = [], []
    for i, (c, n) in enumerate(zip(contexts, new, strict=True)):
        for pos in range(c - n, c):
            slots.append(int(tables[i][pos // bs]) * bs + pos % bs)
    slots.append(-1)  # padding
    T = sum(new) + 1
    q, k, v = torch.randn(T, H, D), torch.randn(T, KVH, D), torch.randn(T, KVH, D)
    before = cache.clone()
    out = attention(
        q,
        k,
        v,
        cache,
        torch.tensor(slots),
        torch.tensor([0, 1, 2, 8], dtype=torch.int32),
        torch.tensor(contexts, dtype=torch.int32),
        block_table,
        D**-0.5,
        0,
    )
    written = torch.zeros(num_blocks + 1, bs, dtype=torch.bool)
    written[num_blocks] = True  # the padding block
    for s in slots[:-1]:
        written[s // bs, s % bs] = True
    assert torch.equal(
        cache.transpose(1, 2)[~written], before.transpose(1, 2)[~written]
    )  # nothing else touched
    start = 0
    for i, (c, n) in enumerate(zip(contexts, new, strict=True)):
        kv = cache[tables[i]].transpose(1, 2).reshape(-1, 2, KVH, D)[:c]  # [c, 2, KVH, D]
        torch.testing.assert_close(kv[c - n :, 0], k[start : start + n])
        expected = _naive_attention(q[start : start + n], kv[:, 0], kv[:, 1], D**-0.5)
        torch.testing.assert_close(out[start : start + n], expected, rtol=1e-5, atol=1e-5)
        rows.append(start)
        start += n


def test_paged_tables_read_each_rows_own_pages_of_a_wide_table() -> None:
    """FlashInfer's page tables (StepLayout.paged) from a graph's full-width block table: each row's pages
    in order, a padding row (length 0) one page, and nothing past a row's last page."""
    seq_lens = np.array([1, 16, 17, 0, 40], dtype=np.int32)
    table = np.arange(5 * 64, dtype=np.int32).reshape(5, 64)  # max_model_len 1,024 at 16 a block
    layout = StepLayout(np.arange(6, dtype=np.int32), seq_lens, table, decode_only=True, graph=True)
    indptr, indices, last_page_len, kv_lens = layout.paged(16)
    pages = [1, 1, 2, 1, 3]
    assert indptr.tolist() == [0, 1, 2, 4, 5, 8]
    assert indices.tolist() == [i for row, n in enumerate(pages) for i in table[row, :n].tolist()]
    assert last_page_len.tolist() == [1, 16, 1, 1, 8]
    assert kv_lens.tolist() == [1, 16, 17, 1, 40]
    assert {a.dtype for a in (indptr, indices, last_page_len, kv_lens)} == {np.dtype(np.int32)}
