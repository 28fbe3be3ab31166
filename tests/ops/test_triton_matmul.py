"""The deterministic mode's GEMM: a row's result is the same bits whatever rows share its call, and close
to torch's. On a CPU it runs in Triton's interpreter (TRITON_INTERPRET=1, set in tests/conftest.py)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from kiln.ops.triton.matmul import BLOCK_M, TritonMatmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M, K, N = 80, 96, 80  # two row tiles, two column tiles, a partial K step
# (offset, rows): alone, in small batches, across a tile edge, at the end.
SLICES = [(0, 1), (5, 1), (79, 1), (3, 2), (62, 3), (10, 7), (60, 16), (64, 16)]
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 1e-2, "rtol": 1e-2}}
MM = TritonMatmul()


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def tiles_are_row_invariant() -> bool:
    """Triton's interpreter multiplies each pair of tiles with numpy's matmul. On some CPUs numpy's BLAS
    gives a row different bits by its place in the tile (OpenBLAS's kernels for AMD EPYC edge-handle
    rows by 12s); a GPU's MMA does not."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(BLOCK_M, BLOCK_M, generator=gen).numpy() for _ in range(2))
    whole = a @ b
    for row in range(BLOCK_M):
        alone = np.zeros_like(a)
        alone[0] = a[row]
        if not np.array_equal((alone @ b)[0], whole[row]):
            return False
    return True


def assert_rows_invariant(f, x: torch.Tensor, whole: torch.Tensor) -> None:
    slices = SLICES
    if DEVICE == "cpu" and not tiles_are_row_invariant():
        # The interpreter can then show invariance only for rows that keep their place in their tile
        # (tests/gpu/test_deterministic.py checks the rest on a GPU).
        slices = [(start, rows) for start, rows in SLICES if start % BLOCK_M == 0]
    for start, rows in slices:
        part = f(x[start : start + rows])
        assert torch.equal(part, whole[start : start + rows]), (start, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_rows_are_the_same_bits_in_any_batch(dtype: torch.dtype, with_bias: bool) -> None:
    assert BLOCK_M < M
    x, w = rand(M, K, dtype=dtype), rand(N, K, dtype=dtype) / 8
    bias = rand(N, dtype=dtype) if with_bias else None
    whole = MM.linear(x, w, bias, N)
    assert whole.dtype == dtype and whole.shape == (M, N)
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    torch.testing.assert_close(whole.float(), ref, **TOL[dtype])
    assert_rows_invariant(lambda part: MM.linear(part, w, bias, N), x, whole)


def test_logits_are_float32_and_batch_invariant() -> None:
    hidden, head = rand(M, K, dtype=torch.bfloat16), rand(N, K, dtype=torch.bfloat16) / 8
    whole = MM.logits(hidden, head, N)
    assert whole.dtype == torch.float32
    torch.testing.assert_close(whole, hidden.float() @ head.float().T, atol=1e-4, rtol=1e-4)
    assert_rows_invariant(lambda part: MM.logits(part, head, N), hidden, whole)


def test_logits_widen_float32_hidden_for_a_float32_head_and_pack_is_identity() -> None:
    hidden, head, bias = rand(3, K), rand(N, K), rand(N)
    assert MM.pack(head) is head and MM.pack_head(head) is head and MM.pack_bias(bias) is bias
    torch.testing.assert_close(MM.logits(hidden, head, N), hidden @ head.T, atol=1e-4, rtol=1e-4)
