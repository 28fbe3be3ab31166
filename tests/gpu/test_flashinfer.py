"""FlashInfer attention and sampling against the torch references, on the GPU."""

import numpy as np
import pytest
import torch

from kiln.ops.attention import AttnMetadata, StepLayout
from kiln.ops.torch_attention import TORCH_ATTENTION
from tests.sampling_expectation import CASES, check_distribution, check_seeded_row_is_independent

BS, KVH, BLOCKS = 16, 2, 64


def _step(
    ctx_lens: list[int], q_lens: list[int], decode_only: bool, D: int, window: int = 0, H: int = 4,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> None:  # fmt: skip
    """A step over a random cache of kv_dtype under bf16 queries: request i has ctx_lens[i] cached tokens
    and q_lens[i] new ones."""
    from kiln.ops.flashinfer_attention import FlashInferAttention

    torch.manual_seed(0)
    dev = torch.device("cuda")
    cache = torch.randn(BLOCKS + 1, 2, BS, KVH, D, device=dev).to(kv_dtype)
    seq = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    width = max(2, max(-(-s // BS) for s in seq))
    perm = np.random.default_rng(0).permutation(BLOCKS)[: len(seq) * width].reshape(len(seq), width)
    table = perm.astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx_lens, q_lens, strict=True)])
    req = np.repeat(np.arange(len(seq)), q_lens)
    slots = table[req, positions // BS].astype(np.int64) * BS + positions % BS
    T = int(qsl[-1])
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    meta = AttnMetadata(
        torch.from_numpy(slots).to(dev),
        torch.from_numpy(qsl).to(dev),
        torch.tensor(seq, dtype=torch.int32, device=dev),
        torch.from_numpy(table).to(dev),
        decode_only,
    )
    fi = FlashInferAttention(H, KVH, D, BS, torch.bfloat16, kv_dtype, dev, width, D**-0.5, window, len(seq))
    fi.plan(StepLayout(qsl, np.array(seq, dtype=np.int32), table, decode_only, False))
    ref_cache = cache.clone()
    want = TORCH_ATTENTION.forward(q, k, v, ref_cache, meta, D**-0.5, window)
    got = fi.forward(q, k, v, cache, meta, D**-0.5, window)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(cache[:BLOCKS], ref_cache[:BLOCKS])  # the same K/V landed in the same slots


HEAD_DIMS = pytest.mark.parametrize("D", [64, 128])


@HEAD_DIMS
def test_prefill(D: int) -> None:
    _step([0, 0, 0], [37, 5, 16], decode_only=False, D=D)


@HEAD_DIMS
def test_decode(D: int) -> None:
    _step([40, 1, 15, 100], [1, 1, 1, 1], decode_only=True, D=D)


@HEAD_DIMS
def test_chunked_prefill_on_a_cached_prefix_mixed_with_decodes(D: int) -> None:
    _step([48, 20, 7], [33, 1, 1], decode_only=False, D=D)


def test_tensor_core_decode() -> None:
    """Four query heads per KV head (Llama-3-8B's ratio) decode on tensor cores."""
    _step([40, 1, 15, 100], [1, 1, 1, 1], decode_only=True, D=128, H=8)


@pytest.mark.parametrize("H", [4, 8])  # CUDA-core decode, tensor-core decode
@pytest.mark.parametrize("decode_only", [False, True])
def test_fp8_cache(decode_only: bool, H: int) -> None:
    """--kv-cache-dtype fp8: FlashInfer reads the e4m3 values the torch reference reads (FA2 prefill;
    FA3 would need fp8 queries), and the writer stores the reference's bits."""
    q_lens = [1, 1, 1] if decode_only else [33, 1, 1]
    _step([48, 20, 7], q_lens, decode_only=decode_only, D=128, H=H, kv_dtype=torch.float8_e4m3fn)


@HEAD_DIMS
@pytest.mark.parametrize("decode_only", [False, True])
def test_sliding_window(decode_only: bool, D: int) -> None:
    q_lens = [1, 1, 1] if decode_only else [33, 1, 1]
    _step([48, 20, 7], q_lens, decode_only=decode_only, D=D, window=16)


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), CASES)
def test_flashinfer_sampling_distribution(top_k: int, top_p: float, min_p: float) -> None:
    """FlashInfer's draw against the same expectation the torch sampler's CPU test uses."""
    from kiln.ops.flashinfer_sampling import draw_tokens

    check_distribution(draw_tokens, torch.device("cuda"), top_k, top_p, min_p)


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), CASES)
def test_torch_sampling_distribution_on_cuda(top_k: int, top_p: float, min_p: float) -> None:
    """The torch sampler (backend.sampler: torch) on the GPU: its sort-based cut and its one-uniform draw
    against the same expectation."""
    check_distribution(None, torch.device("cuda"), top_k, top_p, min_p)


def test_flashinfer_seeded_row_is_independent_of_the_batch() -> None:
    """A seeded row's tokens do not depend on its neighbours' filters: FlashInfer's kernels for top-k/top-p,
    top-p alone and plain draws each use the generator differently, so the row's own filters must pick
    them."""
    from kiln.ops.flashinfer_sampling import draw_tokens

    check_seeded_row_is_independent(draw_tokens, torch.device("cuda"))


def test_a_mixed_step_reading_more_than_16m_kv_tokens() -> None:
    """130 requests of 131,072 tokens each read 17.0M KV tokens in one mixed step, past the 16M token index
    FlashInfer's FA3 allocates. Each context is one 1,024-token cycle of 64 blocks repeated 128 times, so
    its attention equals that over the cycle once (every key weighs as often), which the torch reference
    computes."""
    from kiln.ops.flashinfer_attention import FlashInferAttention

    torch.manual_seed(0)
    dev, D, H, n, repeats = torch.device("cuda"), 64, 4, 130, 128
    cache = torch.randn(BLOCKS + 1, 2, BS, KVH, D, device=dev, dtype=torch.bfloat16)
    cycle = np.arange(BLOCKS, dtype=np.int32)
    width = BLOCKS * repeats
    q, k, v = (torch.randn(n, h, D, device=dev, dtype=torch.bfloat16) for h in (H, KVH, KVH))
    qsl = np.arange(n + 1, dtype=np.int32)

    def meta(blocks: np.ndarray) -> tuple[AttnMetadata, StepLayout]:
        table = np.tile(blocks, (n, 1))
        seq = np.full(n, table.shape[1] * BS, dtype=np.int32)
        m = AttnMetadata(
            torch.full((n,), -1, dtype=torch.int64, device=dev),  # the new K/V go to the padding block
            torch.from_numpy(qsl).to(dev),
            torch.from_numpy(seq).to(dev),
            torch.from_numpy(table).to(dev),
            False,
        )
        return m, StepLayout(qsl, seq, table, False, False)

    fi = FlashInferAttention(H, KVH, D, BS, torch.bfloat16, torch.bfloat16, dev, width, D**-0.5, 0, 8)
    long_meta, layout = meta(np.tile(cycle, repeats))
    assert int(layout.seq_lens.sum()) > 16 * 2**20
    fi.plan(layout)
    got = fi.forward(q, k, v, cache, long_meta, D**-0.5, 0)
    short_meta, _ = meta(cycle)
    want = TORCH_ATTENTION.forward(q, k, v, cache.clone(), short_meta, D**-0.5, 0)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    if fi.fa3:
        assert fi.prefill._vector_sparse_indices_buffer.numel() >= int(layout.seq_lens.sum())


@pytest.mark.parametrize(
    ("q_lens", "decode_only", "graph", "deterministic"),
    [
        ([33, 1, 1], False, False, False),
        ([1, 1, 1], True, False, False),
        ([1, 1, 1], True, True, False),
        ([1, 1, 1], True, True, True),  # the prefill kernel's graph wrapper (FA3 on Hopper)
    ],
    ids=["mixed", "decode", "graph-decode", "deterministic-graph-decode"],
)
def test_plan_returns_while_the_last_step_runs(
    q_lens: list[int], decode_only: bool, graph: bool, deterministic: bool
) -> None:
    """Async scheduling plans a step while the last one runs on the device. A copy from pageable host memory
    may make the driver wait for the stream (FA3's plan makes one; decode's non-graph plan another), which
    torch's sync debug mode does not see: here the stream is still busy with a long sleep after plan()
    returns, or plan() waited for it."""
    from kiln.ops.flashinfer_attention import FlashInferAttention

    dev, D, H = torch.device("cuda"), 128, 4
    seq = np.array([48 + q_lens[0], 21, 8], dtype=np.int32)
    table = np.random.default_rng(0).permutation(BLOCKS)[:18].reshape(3, 6).astype(np.int32)  # 96 tokens
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    fi = FlashInferAttention(
        H,
        KVH,
        D,
        BS,
        torch.bfloat16,
        torch.bfloat16,
        dev,
        table.shape[1],
        D**-0.5,
        0,
        len(seq),
        deterministic,
    )
    layout = StepLayout(qsl, seq, table, decode_only, graph)
    fi.plan(layout)  # the first plan of a kind loads its module
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles
    fi.plan(layout)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "plan() waited for the work queued before it"
