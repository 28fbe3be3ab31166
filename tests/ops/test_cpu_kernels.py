"""kiln's CPU kernels: close to torch's reference, and a row's bits never depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

from kiln.ops.activation import silu_and_mul
from kiln.ops.cpu import moe as cpu_moe
from kiln.ops.cpu import native
from kiln.ops.cpu import rotary as cpu_rotary
from kiln.ops.cpu.attention import from_standard, pair_layout, write_kv
from kiln.ops.matmul import CpuMatmul
from kiln.ops.moe import moe_experts, route
from kiln.ops.rotary import apply_rotary, rope_cos_sin, rope_inv_freq
from kiln.ops.torch_attention import attention as reference_attention
from kiln.ops.torch_attention import write_kv as standard_write

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # --kv-cache-dtype fp8_e4m3, fp8_e5m2


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    native.load()  # the CPU backend's kernels: a machine that cannot build them fails here, loudly


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), [(100, 40), (576, 1536)])
def test_linear_rows_are_batch_invariant(dtype: torch.dtype, n: int, k: int) -> None:
    torch.manual_seed(0)
    w, bias, x = torch.randn(n, k).to(dtype), torch.randn(n), torch.randn(29, k)
    mm = CpuMatmul()
    packed = mm.pack(w)
    full = mm.linear(x, packed, bias, n)
    torch.testing.assert_close(full, x @ w.float().t() + bias, rtol=1e-4, atol=1e-4)
    for rows in (1, 2, 3, 5, 6, 7, 13):
        for at in (0, 4, 29 - rows):
            assert torch.equal(mm.linear(x[at : at + rows], packed, bias, n), full[at : at + rows])


@pytest.mark.parametrize(("n", "k"), [(100, 41), (576, 1536), (1536, 576)])
def test_bf16_pairs_are_bfloat16_products_and_batch_invariant(n: int, k: int) -> None:
    """AVX512-BF16: x is rounded to bfloat16 and multiplied by bfloat16 weights in pairs, accumulated in
    float32 (with AMX, in tiles of up to 16 rows); K is padded with zero pairs to whole tiles of 32. Where
    K is whole tiles, x may come rounded already (CpuMatmul rounds it), with the same bits. Kernels built
    without it refuse pair-packed weights (the backend never packs them there)."""
    torch.manual_seed(0)
    w, bias, x = torch.randn(n, k).bfloat16(), torch.randn(n), torch.randn(64, k)
    mm = CpuMatmul(bf16_dot=True)
    packed = mm.pack(w)
    assert packed.shape == (-(-n // 16), -(-k // 32) * 16, 16, 2)
    if not native.bf16_dot():
        with pytest.raises(RuntimeError, match="need a CPU with AVX512-BF16"):
            mm.linear(x, packed, bias, n)
        return
    full = mm.linear(x, packed, bias, n)
    want = x.bfloat16().double() @ w.double().t() + bias.double()
    torch.testing.assert_close(full.double(), want, rtol=1e-5, atol=1e-4)
    for rows in (1, 2, 3, 7, 8, 9, 13, 16, 17, 31, 33, 50):
        for at in (0, 4, 64 - rows):
            assert torch.equal(mm.linear(x[at : at + rows], packed, bias, n), full[at : at + rows])
    assert torch.equal(torch.ops.kiln_cpu.linear(x, packed, n, bias), full)
    strided = torch.randn(64, k + 3)[:, :k]
    strided.copy_(x)
    assert torch.equal(mm.linear(strided, packed, bias, n), full)
    many = torch.randn(600, k)  # past one block of rows: the AMX kernel takes x in blocks of up to 512 KiB
    whole = mm.linear(many, packed, bias, n)
    bare = mm.linear(many, packed, None, n)  # without a bias, whole tiles store straight into y
    assert torch.equal(bare + bias, whole)
    for at, rows in ((0, 1), (0, 40), (150, 33), (440, 40), (583, 17)):
        assert torch.equal(mm.linear(many[at : at + rows], packed, bias, n), whole[at : at + rows])
        assert torch.equal(mm.linear(many[at : at + rows], packed, None, n), bare[at : at + rows])
    if k % 32 == 0:
        for pad in (32, 3):  # rows an even or odd number of bfloat16 apart: read in place, or copied
            rounded = torch.randn(64, k + pad).bfloat16()[:, :k]
            rounded.copy_(x)
            assert torch.equal(torch.ops.kiln_cpu.linear(rounded, packed, n, bias), full)
    else:
        with pytest.raises(RuntimeError, match="bfloat16 x needs K a multiple of 32"):
            torch.ops.kiln_cpu.linear(x.bfloat16(), packed, n, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_moe_experts_match_the_reference_and_are_batch_invariant(dtype: torch.dtype) -> None:
    """Experts packed by CpuMatmul (an odd width, 40, which pairs pad to 64 with zero rows and columns)
    through kiln's kernels, as this CPU runs them: close to the reference on the same weights, and a
    token's bits are the same alone, in any slice of the batch, and beside other tokens that route to its
    experts."""
    torch.manual_seed(0)
    tokens, hidden, width, experts, top_k = 37, 64, 40, 6, 2
    x = torch.randn(tokens, hidden)
    w13, w2 = (
        (torch.randn(experts, 2 * width, hidden) * 0.1).to(dtype),
        (torch.randn(experts, hidden, width) * 0.1).to(dtype),
    )
    weights, ids = route(torch.randn(tokens, experts), top_k, renormalize=True)
    mm = CpuMatmul(bf16_dot=native.bf16_dot(), amx=native.amx())
    pairs = mm.bf16_dot and dtype == torch.bfloat16
    p13, p2 = mm.pack_experts(w13, w2)
    assert mm.experts_width(p2[0]) == (64 if pairs else width)
    full = cpu_moe.moe_experts(x, p13, p2, weights, ids, mm.amx)
    rows = x.bfloat16().float() if pairs else x  # pairs multiply x rounded to bfloat16
    want = moe_experts(rows, w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(full, want, rtol=2e-2 if pairs else 1e-4, atol=2e-2 if pairs else 1e-4)
    for at, n in ((0, 1), (5, 1), (3, 7), (20, 17), (0, 36)):
        part = cpu_moe.moe_experts(x[at : at + n], p13, p2, weights[at : at + n], ids[at : at + n], mm.amx)
        assert torch.equal(part, full[at : at + n])


@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_is_silu_of_gate_times_up_and_batch_invariant(bias: bool) -> None:
    """On AMX, a gated MLP's up projection packs gate's and up's blocks interleaved and one kernel returns
    silu(gate) * up in bfloat16: the same products as the linear layer's, so the result is the reference's
    rounded to bfloat16 (up to the exponential's last bit); each row's bits are its own whatever the rows
    beside it. Elsewhere the pair stays two kernels, the linear layer then silu * up."""
    torch.manual_seed(0)
    n, k = 1536, 576
    w, x = torch.randn(2 * n, k).bfloat16(), torch.randn(600, k)
    b = torch.randn(2 * n) if bias else None
    mm = CpuMatmul(bf16_dot=native.bf16_dot(), amx=native.amx())
    packed, packed_bias = mm.pack_gate_up(w, b)
    full = mm.gate_up(x, packed, packed_bias, n, silu_and_mul)
    two = silu_and_mul(CpuMatmul(bf16_dot=native.bf16_dot()).linear(x, mm.pack(w), b, 2 * n))
    if not native.amx():
        assert torch.equal(full, two)
        return
    assert full.dtype == torch.bfloat16 and full.shape == (600, n)
    torch.testing.assert_close(full.float(), two.bfloat16().float(), rtol=2**-7, atol=1e-6)
    assert (full != two.bfloat16()).float().mean() < 1e-3  # rounding ties aside, the same bits
    for at, rows in ((0, 1), (3, 16), (5, 17), (100, 33), (150, 64), (583, 17)):
        part = mm.gate_up(x[at : at + rows], packed, packed_bias, n, silu_and_mul)
        assert torch.equal(part, full[at : at + rows])
    assert torch.equal(mm.gate_up(x.bfloat16(), packed, packed_bias, n, silu_and_mul), full)


def _attend(
    q: torch.Tensor, cache: torch.Tensor, qsl: list[int], lens: list[int], tables: list, window: int,
    pairs: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """pairs: the layout (None: the one kiln picks for the cache's dtype here)."""
    i32 = torch.int32
    q_start, seq = torch.tensor(qsl, dtype=i32), torch.tensor(lens, dtype=i32)
    table = torch.tensor(tables, dtype=i32)
    pairs = pair_layout(cache.dtype, cache.shape[-1]) if pairs is None else pairs
    kernel_cache = from_standard(cache, pairs)
    return torch.ops.kiln_cpu.paged_attention(
        q, kernel_cache, q_start, seq, table, q.shape[-1] ** -0.5, window, pairs
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, *FP8])
@pytest.mark.parametrize(
    ("dim", "block", "window"), [(64, 16, 0), (64, 16, 20), (128, 32, 20), (20, 128, 0), (64, 8, 0)]
)
def test_attention_rows_do_not_depend_on_chunking_or_neighbours(
    dtype: torch.dtype, dim: int, block: int, window: int
) -> None:
    """Three requests in one call (a 9-token chunk after a cached prefix, a decode, a fresh 7-token
    prompt) against the torch reference; then each row again alone, in other chunks and as decodes.
    The slots past each context hold NaN: a slot not written yet may hold anything."""
    torch.manual_seed(0)
    heads, kv_heads, blocks = 6, 2, 12
    clean = torch.randn(blocks + 1, 2, block, kv_heads, dim).to(dtype)
    order = torch.randperm(blocks).tolist()
    tables = [order[0:4], order[4:8], order[8:12]]
    qsl, lens = [0, 9, 10, 17], [3 * block - 5, block + 3, 7]
    cache = clean.clone()
    for table, n in zip(tables, lens, strict=True):
        for p in range(n, len(table) * block):
            cache[table[p // block], :, p % block] = float("nan")
    q = torch.randn(17, heads, dim)
    got = _attend(q, cache, qsl, lens, tables, window)
    none = torch.full((17,), -1)
    nothing = torch.zeros(17, kv_heads, dim)
    want = reference_attention(
        q, nothing, nothing, clean.float(), none, torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32), dim**-0.5, window,
    )  # fmt: skip
    # With pairs (bfloat16 on AVX512-BF16) the queries and the softmax weights are rounded to bfloat16.
    tol = 2e-2 if pair_layout(dtype, dim) else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    ctx = lens[0]
    for split in (1, 2, 4, 5):
        head = _attend(q[:split], cache, [0, split], [ctx - 9 + split], [tables[0]], window)
        tail = _attend(q[split:9], cache, [0, 9 - split], [ctx], [tables[0]], window)
        assert torch.equal(torch.cat([head, tail]), got[:9])
    for row in range(9):
        alone = _attend(q[row : row + 1], cache, [0, 1], [ctx - 8 + row], [tables[0]], window)
        assert torch.equal(alone, got[row : row + 1])
    assert torch.equal(_attend(q[9:10], cache, [0, 1], [lens[1]], [tables[1]], window), got[9:10])


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_without_pairs_reads_the_references_values(dtype: torch.dtype) -> None:
    """An fp8 cache on the float path (a CPU without AVX512-BF16: fp8 widened to float32 through half's
    bits) against the torch reference, a chunk and decodes; the same bits for a row alone."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 6, 2, 64, 16
    cache = torch.randn(13, 2, block, kv_heads, dim).to(dtype)
    tables, qsl, lens = [[3, 7, 1, 9], [0, 5, 2, 8]], [0, 9, 10], [3 * block - 5, block + 3]
    q = torch.randn(10, heads, dim)
    got = _attend(q, cache, qsl, lens, tables, 0, pairs=False)
    none, nothing = torch.full((10,), -1), torch.zeros(10, kv_heads, dim)
    want = reference_attention(
        q, nothing, nothing, cache.float(), none, torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32), dim**-0.5, 0,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = _attend(q[9:10], cache, [0, 1], [lens[1]], [tables[1]], 0, pairs=False)
    assert torch.equal(alone, got[9:10])


@pytest.mark.parametrize("block", [16, 32, 64])
def test_long_prefill_rows_do_not_depend_on_chunking(block: int) -> None:
    """A 300-token bfloat16 prefill (with AMX, from blocks of 32: passes of two row tiles, spans its rows
    see whole and spans cut by the causal edge; blocks of 16 take the vector kernel) against the torch
    reference, then in other chunks and as decodes: the same bits for every row. The slots past the
    context hold NaN."""
    torch.manual_seed(1)
    heads, kv_heads, dim, n = 9, 3, 64, 300
    blocks = -(-n // block)
    clean = torch.randn(blocks + 1, 2, block, kv_heads, dim).bfloat16()  # the last: the padding block
    cache = clean.clone()
    table = [torch.randperm(blocks).tolist()]
    for p in range(n, blocks * block):
        cache[table[0][p // block], :, p % block] = float("nan")
    q = torch.randn(n, heads, dim)
    got = _attend(q, cache, [0, n], [n], table, 0)
    want = reference_attention(
        q, torch.zeros(n, kv_heads, dim), torch.zeros(n, kv_heads, dim), clean.float(), torch.full((n,), -1),
        torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
        torch.tensor(table, dtype=torch.int32), dim**-0.5, 0,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for split in (70, 129, 256):
        assert torch.equal(_attend(q[split:], cache, [0, n - split], [n], table, 0), got[split:])
    for row in (63, 64, 200, 299):
        assert torch.equal(_attend(q[row : row + 1], cache, [0, 1], [row + 1], table, 0), got[row : row + 1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, *FP8])
def test_cpu_cache_writes_are_the_kernels_layout(dtype: torch.dtype) -> None:
    """The CPU writer puts K/V where the usual writer would, in the kernel's layout, rounded alike (fp8
    saturating, not NaN, past its range); padding slots (-1) write nothing."""
    torch.manual_seed(0)
    blocks, bs, kv_heads, dim = 5, 16, 3, 20
    k, v = torch.randn(7, kv_heads, dim), torch.randn(7, kv_heads, dim + 4)[..., :dim]  # v: strided rows
    k[1, 0, :2], v[2, 1, :2] = torch.tensor([1e6, -1e6]), torch.tensor([-1e6, 1e6])
    slots = torch.tensor([3, 17, 18, -1, 40, 63, -1])
    usual = torch.zeros(blocks + 1, 2, bs, kv_heads, dim, dtype=dtype)
    ours = torch.zeros_like(usual)
    standard_write(k, v, usual, slots)
    pairs = pair_layout(dtype, dim)
    write_kv(k, v, ours, slots, pairs)
    assert torch.equal(ours[:blocks], from_standard(usual, pairs)[:blocks])
    assert usual[:blocks].float().count_nonzero() > 4 * 2 * kv_heads * dim  # fp8 rounds a few to 0
    assert ours.float().count_nonzero() == usual[:blocks].float().count_nonzero()  # none in padding
    assert not ours.float().isnan().any()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("pairs", [False, True])
def test_fp8_writes_round_as_torch(dtype: torch.dtype, pairs: bool) -> None:
    """Every finite fp8 value, the midpoints between neighbours (ties go to the even one) and values just
    off them, subnormals and zeros of both signs, and values past the largest (saturating): the C++
    writer's bytes are torch's rounding (to_cache), in either layout (placing bytes needs no AVX512-BF16)."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = codes[codes.isfinite()].unique()  # ascending
    mid = (values[1:] + values[:-1]) / 2
    limit = torch.finfo(dtype).max
    x = torch.cat([values, mid, mid.nextafter(values[1:]), mid.nextafter(values[:-1]), torch.tensor([-0.0])])
    x = torch.cat([x, torch.tensor([limit * 1.01, -limit * 3, 1e30, -1e30])])
    dim = 32
    x = torch.cat([x, torch.zeros(-len(x) % dim)]).view(-1, 1, dim)
    tokens = len(x)
    bs = 32
    blocks = -(-tokens // bs)
    usual = torch.zeros(blocks + 1, 2, bs, 1, dim, dtype=dtype)
    ours = torch.zeros_like(usual)
    slots = torch.arange(tokens)
    standard_write(x, -x, usual, slots)
    write_kv(x, -x, ours, slots, pairs)
    assert torch.equal(
        ours[:blocks].view(torch.uint8), from_standard(usual, pairs)[:blocks].view(torch.uint8)
    )


def test_pairs_need_a_bfloat16_cache() -> None:
    cache = torch.zeros(3, 2, 16, 2, 64, dtype=torch.float16)
    i32 = torch.int32
    meta = torch.tensor([0, 1], dtype=i32), torch.tensor([1], dtype=i32), torch.zeros(1, 2, dtype=i32)
    with pytest.raises(RuntimeError, match="pairs need a bfloat16 or fp8 cache"):
        torch.ops.kiln_cpu.paged_attention(torch.randn(1, 6, 64), cache, *meta, 0.125, 0, True)


def test_cpu_attention_needs_block_size_a_multiple_of_8() -> None:
    from types import SimpleNamespace

    from kiln.ops.backend import Backend

    heads = SimpleNamespace(num_heads=6, num_kv_heads=2, head_dim=64, sliding_window=0)
    with pytest.raises(ValueError, match=r"cache\.block_size 12"):
        Backend("cpu", "cpu", "torch").make_attention(
            heads, 12, 64, 1, torch.float16, torch.float16, torch.device("cpu")
        )


@pytest.mark.parametrize("vocab", [64, 49152, 1000 + 7])
def test_grammar_mask_is_xgrammars(vocab: int) -> None:
    """kiln's structured-output mask sets exactly the logits xgrammar's kernel sets, on the listed rows."""
    import xgrammar as xgr

    from kiln.ops.cpu.sampling import apply_bitmask

    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[:, 0], bitmask[:, 1] = -1, 0  # a word that allows all, and one that allows none
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask, [0, 3, 5])
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=[0, 3, 5])
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 2, 4]], logits[[1, 2, 4]])


@pytest.mark.parametrize("vocab", [5, 64, 49152, 1000 + 7])
def test_argmax_is_torchs(vocab: int) -> None:
    """kiln's greedy argmax picks torch.argmax's index: the first maximum, or the first NaN."""
    torch.manual_seed(0)
    logits = torch.randn(9, vocab)
    logits[1] = float("-inf")
    logits[2, vocab // 3] = logits[2, vocab - 1] = 100.0  # a tie: the first one wins
    logits[3, vocab // 2] = logits[3, vocab - 1] = float("nan")
    logits[4, vocab - 1] = float("nan")
    logits[5, vocab - 1] = float("inf")
    strided = torch.randn(9, vocab + 3)[:, :vocab]
    for x in (logits, strided):
        assert torch.equal(torch.ops.kiln_cpu.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize(("tokens", "rotary_dim"), [(1, 64), (5, 32), (7, 20), (300, 64)])
def test_rotary_is_the_references_bits(tokens: int, rotary_dim: int) -> None:
    """kiln's RoPE gives the torch reference's bits for q and k taken as views of a fused qkv output, on
    one thread (a decode's rows) or split across threads (a prefill's), with the head's tail past a partial
    rotary dim passed through (a half of 10 takes the scalar tail); a position past the table is an error,
    not a read past it."""
    torch.manual_seed(0)
    inv_freq, scaling = rope_inv_freq(rotary_dim, 10000.0, None)
    cos_sin = rope_cos_sin(inv_freq, 4096, scaling)
    qkv = torch.randn(tokens, 9 * 64 + 2 * 3 * 64)
    q, k = qkv[:, : 9 * 64].view(tokens, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(tokens, 3, 64)
    positions = torch.randint(0, 4096, (tokens,))
    ours, theirs = cpu_rotary.apply_rotary(positions, q, k, cos_sin), apply_rotary(positions, q, k, cos_sin)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    with pytest.raises(RuntimeError, match="position 4096 outside the table's 4096"):
        cpu_rotary.apply_rotary(torch.full((tokens,), 4096), q, k, cos_sin)
