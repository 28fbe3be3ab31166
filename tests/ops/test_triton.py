"""Every Triton kernel against its torch reference: on a CPU they run in Triton's interpreter
(TRITON_INTERPRET=1, set in tests/conftest.py); on a GPU the same tests run the compiled kernels."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from kiln import LLM
from kiln.ops import activation, moe, norm, rotary
from kiln.ops.backend import TORCH_BACKEND
from kiln.ops.sampler import prepare_logits
from kiln.ops.sampling_metadata import Penalties, SamplingMetadata
from kiln.ops.torch_attention import write_kv as torch_write_kv
from kiln.ops.triton import activation as t_activation
from kiln.ops.triton import moe as t_moe
from kiln.ops.triton import norm as t_norm
from kiln.ops.triton import rotary as t_rotary
from kiln.ops.triton import sampling as t_sampling
from kiln.ops.triton.kv_cache import write_kv
from kiln.sampling_params import SamplingParams
from tests.models.test_architectures import PROMPTS
from tests.models.tiny import build

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# fp32: accumulation order only. bf16: one rounding of the output (2^-8 relative) either way.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 1.6e-2}}


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, with_residual: bool) -> None:
    x, weight = rand(7, 129, dtype=dtype), rand(129, dtype=dtype)
    residual = rand(7, 129, dtype=dtype) if with_residual else None
    out, total = t_norm.rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_total = norm.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    # One rounding of the same sum (the interpreter's bf16 cast truncates where a GPU rounds: 1 ulp).
    torch.testing.assert_close(total, ref_total, **TOL[dtype])


def test_rms_norm_per_head_on_a_strided_view() -> None:
    qkv, weight = rand(5, 3 * 4 * 24), rand(24)
    q = qkv[:, : 4 * 24].view(5, 4, 24)  # q_norm's input: a view of the fused projection
    torch.testing.assert_close(t_norm.rms_norm(q, weight, 1e-5)[0], norm.rms_norm(q, weight, 1e-5)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = rand(9, 2 * 37, dtype=dtype)
    torch.testing.assert_close(t_activation.silu_and_mul(x), activation.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("neox", "rot_dim"), [(True, 32), (True, 16), (False, 32), (False, 20)])
def test_rotary_in_place_on_qkv_views(dtype: torch.dtype, neox: bool, rot_dim: int) -> None:
    T, H, KVH, D = 11, 6, 2, 32
    qkv = rand(T, (H + 2 * KVH) * D, dtype=dtype)
    q, k, _ = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k = q.view(T, H, D), k.view(T, KVH, D)
    positions = torch.randint(0, 100, (T,), device=DEVICE)
    inv_freq, scale = rotary.rope_inv_freq(rot_dim, 10000.0, None)
    cos_sin = rotary.rope_cos_sin(inv_freq, 128, scale).to(DEVICE)
    ref_q, ref_k = rotary.apply_rotary(positions, q.clone(), k.clone(), cos_sin, neox)
    untouched = qkv[:, (H + KVH) * D :].clone()
    out_q, out_k = t_rotary.apply_rotary(positions, q, k, cos_sin, neox)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    assert torch.equal(qkv[:, (H + KVH) * D :], untouched)  # V is not rotated


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        *((d, d) for d in DTYPES),
        (torch.bfloat16, torch.float16),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.float32, torch.float8_e5m2),
    ],
)
def test_write_kv_skips_padding_slots(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """The reference's bits, fp8 caches (--kv-cache-dtype) included, saturating past their range. The
    values fp8 can hold exactly: the interpreter's rounding to fp8 drops a carry (0.1198 to e5m2 gives
    0.0625, not 0.125), where a GPU's conversion rounds to nearest even, as torch does."""
    blocks, bs, KVH, D, T = 6, 4, 3, 8, 9
    cache = rand(blocks + 1, 2, bs, KVH, D, dtype=cache_dtype)
    qkv = rand(T, 3 * KVH * D, dtype=cache_dtype).to(dtype)
    qkv[0, KVH * D : KVH * D + 4] = torch.tensor([1e5, -1e5, 3e4, -3e4])
    _, k, v = (t.view(T, KVH, D) for t in qkv.split(KVH * D, dim=-1))
    slots = torch.tensor([5, -1, 0, 23, -1, 17, 9, 10, -1], device=DEVICE)
    want = cache.clone()
    torch_write_kv(k, v, want, slots)
    want[-1] = cache[-1]  # the reference sends padding to the padding block; the kernel writes nothing
    write_kv(k, v, cache, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_fused_moe(dtype: torch.dtype, num_tokens: int) -> None:
    E, top_k, H, inter = 5, 2, 48, 40
    x = rand(num_tokens, H, dtype=dtype)
    w13, w2 = rand(E, 2 * inter, H, dtype=dtype) / 4, rand(E, H, inter, dtype=dtype) / 4
    weights, ids = moe.route(rand(num_tokens, E), top_k, renormalize=True)
    out = t_moe.moe_experts(x, w13, w2, weights, ids)
    ref = moe.moe_experts(x.float(), w13.float(), w2.float(), weights, ids)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 3e-2}
    torch.testing.assert_close(out.float(), ref, **tol)


def test_fused_moe_deterministic_computes_what_the_default_does() -> None:
    """Its tile and its sum differ (batch invariance itself is a GPU's property: numpy's BLAS, the
    interpreter's dot, gives a row bits that depend on its place in the tile; tests/gpu checks it)."""
    E, top_k, H, inter, T = 6, 3, 48, 40, 70  # 210 pairs > 64 x 6: the default path takes tiles of 64
    x = rand(T, H)
    w13, w2 = rand(E, 2 * inter, H) / 4, rand(E, H, inter) / 4
    weights, ids = moe.route(rand(T, E), top_k, renormalize=True)
    got = t_moe.moe_experts(x, w13, w2, weights, ids, deterministic=True)
    torch.testing.assert_close(got, t_moe.moe_experts(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_moe_alignment_groups_every_pair_once_by_expert() -> None:
    ids = torch.tensor([[0, 3], [3, 1], [0, 3], [4, 0]], device=DEVICE)
    sorted_pairs, block_expert, padded = t_moe.align_by_expert(ids, 5, block_m=4)
    rows = sorted_pairs.view(-1, 4)
    real = sorted_pairs[sorted_pairs < ids.numel()]
    assert sorted(real.tolist()) == list(range(ids.numel()))  # every pair exactly once
    assert padded.item() == 4 * 4  # experts 0, 1, 3, 4 take one block each; expert 2 none
    for block in range(padded.item() // 4):
        pairs = rows[block][rows[block] < ids.numel()]
        assert (ids.flatten()[pairs] == block_expert[block]).all()


def test_sampling_prep_matches_the_reference() -> None:
    vocab = 1037
    params = [
        SamplingParams(temperature=0.7, repetition_penalty=1.3, logit_bias={5: 2.0, 1000: -1.5}),
        SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(temperature=1.5, logit_bias={7: 100.0}),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.3, presence_penalty=-0.5, repetition_penalty=0.8),
    ]
    prompts = [[1, 2, 3, 5], [9], [4, 4], [], [1000, 2]]
    outputs = [[5, 5, 6], [9, 9, 9, 10], [], [3], [2, 2]]
    banned = [[], [], [7, 8], [0], []]
    device = torch.device(DEVICE)
    penalties = Penalties.from_ids(params, prompts, outputs, vocab, device)
    meta = SamplingMetadata.build(params, [None] * 5, banned, vocab, device, penalties)
    logits = rand(5, vocab) * 3
    want = prepare_logits(logits, meta)
    got = t_sampling.prepare_logits(logits, meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    assert got[2, 7] == float("-inf") and got[3, 0] == float("-inf")  # banned beats a +100 bias


def test_sampling_prep_without_penalties_is_temperature_only() -> None:
    meta = SamplingMetadata.build(
        [SamplingParams(temperature=0.5)] * 3,
        [None] * 3,
        [[]] * 3,
        300,
        torch.device(DEVICE),
    )
    logits = rand(3, 300)
    torch.testing.assert_close(t_sampling.prepare_logits(logits, meta), logits / 0.5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral"])
def test_tiny_models_with_triton_kernels_give_the_torch_tokens(arch: str, tmp_path: Path) -> None:
    """Every kernel in its place in the model (norms, rotary, SiLU, MoE, sampling prep), fp32, eager and
    under torch.compile (where the interpreter's kernels are opaque ops: the GPU's traced-through kernels
    are tests/gpu's)."""
    build(arch, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.2)
    runs = {}
    for kernels, mode in (("torch", "eager"), ("triton", "eager"), ("triton", "compiled")):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_gib=0.01, mode=mode, kernels=kernels)
        assert llm.engine.model.kernels.name == kernels
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        runs[kernels, mode] = [o.outputs[0].token_ids for o in outputs]
    assert runs["triton", "eager"] == runs["torch", "eager"]
    assert runs["triton", "compiled"] == runs["torch", "eager"]


def test_auto_backend_on_a_cpu_is_kilns_cpu_kernels_and_never_imports_flashinfer() -> None:
    import sys

    from kiln.ops.backend import Backend, choose_backend

    cpu = torch.device("cpu")
    assert choose_backend("auto", "auto", "auto", cpu, 64, torch.bfloat16) == Backend("cpu", "cpu", "torch")
    assert choose_backend("torch", "torch", "auto", cpu, 64, torch.bfloat16) == TORCH_BACKEND
    assert "flashinfer" not in sys.modules
    with pytest.raises(ValueError, match=r"backend\.attention 'flashinfer' needs a CUDA device"):
        choose_backend("auto", "flashinfer", "auto", cpu, 64, torch.bfloat16)


@pytest.mark.parametrize(
    ("head_dim", "dtype", "why"),
    [
        (16, torch.bfloat16, "head_dim 16"),
        (32, torch.float16, "head_dim 32"),
        (128, torch.float32, "dtype float32"),
    ],
)
def test_flashinfer_is_refused_for_what_its_kernels_cannot_serve(
    head_dim: int, dtype: torch.dtype, why: str
) -> None:
    """Explicitly asked for, it is a config error naming the reason; auto takes the torch attention."""
    from kiln.ops.backend import choose_backend, flashinfer_unsupported

    assert why in (flashinfer_unsupported(head_dim, dtype) or "")
    # Only the device's type is read: the refusal is checked without a GPU.
    with pytest.raises(ValueError, match=rf"backend\.attention 'flashinfer' cannot serve this model's {why}"):
        choose_backend("auto", "flashinfer", "auto", torch.device("cuda"), head_dim, dtype)
    assert (
        flashinfer_unsupported(128, torch.bfloat16) is None
        and flashinfer_unsupported(64, torch.float16) is None
    )
