"""backend.deterministic on the GPU: FlashInfer gives a query row the same bits in every kind of step, and
a request's greedy tokens (dense and MoE models) are the same alone, in batches of 4 and 16 among random
neighbours (some chunked, some sampled), and again with its prefix cached, with the Triton GEMM,
FlashInfer without split-KV and CUDA graphs all on."""

import itertools
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.ops.attention import AttnMetadata, StepLayout
from tests.models.tiny import VOCAB, build

# Across several pages and FlashInfer KV tiles; the longest is prefilled in chunks of the 64-token budget.
TARGETS = [[int(t) for t in random.Random(n).choices(range(1, VOCAB), k=n)] for n in (5, 40, 150)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def neighbours(rng: random.Random, count: int) -> list[tuple[list[int], SamplingParams]]:
    out = []
    for _ in range(count):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 200))]
        temp = rng.choice([0.0, 0.8])
        out.append((ids, SamplingParams(temperature=temp, max_tokens=rng.randint(1, 40), ignore_eos=True)))
    return out


def run(llm: LLM, batch: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": ids} for ids, _ in batch]
    outs = llm.generate(prompts, [p for _, p in batch], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(("arch", "head_dim"), [("llama", 64), ("llama", 128), ("qwen3_moe", 64)])
def test_greedy_tokens_do_not_depend_on_the_batch_or_the_prefix_cache(
    arch: str, head_dim: int, tmp_path: Path
) -> None:
    build(arch, tmp_path, head_dim)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", deterministic=True, kv_cache_gib=0.05,
              max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)  # fmt: skip
    engine = llm.engine
    assert (engine.backend.kernels, engine.backend.attention) == ("triton", "flashinfer")
    assert type(engine.model.kernels.matmul).__name__ == "TritonMatmul"
    graphs = engine.runner.lowering.graphs
    assert graphs is not None and graphs.captured, "CUDA graphs stay on in deterministic mode"

    targets = [(ids, GREEDY) for ids in TARGETS]
    alone = [run(llm, [t])[0] for t in targets]
    hits = engine.stats()["prefix_cache_hits"]
    assert [run(llm, [t])[0] for t in targets] == alone, "with the prefix cached"
    assert engine.stats()["prefix_cache_hits"] > hits

    rng = random.Random(head_dim)
    for size in (4, 16):
        for _ in range(2):
            batch = neighbours(rng, size - len(targets))
            where = sorted(rng.sample(range(size), len(targets)))
            for i, t in zip(where, targets, strict=True):
                batch.insert(i, t)
            got = run(llm, batch)
            assert [got[i] for i in where] == alone, f"batch of {size}, targets at {where}"
    assert engine.runner.lowering.misses == 0


H, KVH, BS, BLOCKS, WIDTH, L = 8, 2, 16, 128, 16, 150
Req = tuple[np.ndarray, int, torch.Tensor]  # block-table row, cached tokens, new tokens' queries


def attend(fi, cache: torch.Tensor, reqs: list[Req], decode_only: bool, graph: bool = False) -> list:
    """One step over a fixed cache (every slot -1: nothing is written); each request's output rows."""
    dev, d = cache.device, cache.shape[-1]
    qsl = np.concatenate([[0], np.cumsum([len(q) for _, _, q in reqs])]).astype(np.int32)
    seq = np.array([c + len(q) for _, c, q in reqs], dtype=np.int32)
    table = np.stack([t for t, _, _ in reqs]).astype(np.int32)
    q = torch.cat([q for _, _, q in reqs])
    kv = torch.zeros(len(q), KVH, d, device=dev, dtype=q.dtype)
    slots = torch.full((len(q),), -1, device=dev)
    meta = AttnMetadata(slots, *(torch.from_numpy(a).to(dev) for a in (qsl, seq, table)), decode_only)
    fi.plan(StepLayout(qsl, seq, table, decode_only, graph))
    out = fi.forward(q, kv, kv, cache, meta, d**-0.5, 0)
    return [out[a:b] for a, b in itertools.pairwise(qsl)]


@pytest.mark.parametrize("D", [64, 128])
def test_flashinfer_rows_are_the_same_bits_in_every_kind_of_step(D: int) -> None:
    from kiln.ops.flashinfer_attention import FlashInferAttention

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    dev = torch.device("cuda")
    cache = torch.randn(BLOCKS + 1, 2, BS, KVH, D, device=dev, dtype=torch.bfloat16)
    fi = FlashInferAttention(
        H, KVH, D, BS, torch.bfloat16, torch.bfloat16, dev, WIDTH, D**-0.5, 0, 8, deterministic=True
    )
    table = rng.permutation(BLOCKS)[:WIDTH]
    q = torch.randn(L, H, D, device=dev, dtype=torch.bfloat16)
    last = (table, L - 1, q[-1:])

    def other(ctx: int, n: int) -> Req:
        return rng.permutation(BLOCKS)[:WIDTH], ctx, torch.randn(n, H, D, device=dev, dtype=torch.bfloat16)

    decodes = [other(int(rng.integers(1, 200)), 1) for _ in range(7)]
    padding = [(np.full(WIDTH, BLOCKS), 0, q[:1])] * 6  # as the lowering pads a graph's batch
    whole = attend(fi, cache, [(table, 0, q)], decode_only=False)[0]
    steps = {
        "a chunk on a cached prefix, beside a prefill and a decode": attend(
            fi, cache, [other(0, 37), (table, 120, q[120:]), other(20, 1)], decode_only=False
        )[1],
        "a decode alone": attend(fi, cache, [last], decode_only=True)[0],
        "a decode among 7 others": attend(fi, cache, [*decodes[:3], last, *decodes[3:]], decode_only=True)[3],
        "a decode in a padded graph batch": attend(
            fi, cache, [last, decodes[0], *padding], decode_only=True, graph=True
        )[0],
        "a decode beside prefill chunks": attend(
            fi, cache, [other(0, 60), last, other(30, 9)], decode_only=False
        )[1],
    }
    for name, rows in steps.items():
        assert torch.equal(rows, whole[L - len(rows) :]), name


def test_a_decode_graph_reading_more_than_16m_kv_tokens_matches_the_step_outside_graphs() -> None:
    """FA3 expands a step's pages into one index per KV token, in a buffer FlashInfer sizes for 16M tokens
    and never checks. A deterministic decode graph reads the buffer it was captured with, so it is sized
    for the graph's batch at max_model_len: here 64 rows of 512k tokens (one cached prefix, shared), 32M."""
    from kiln.ops.flashinfer_attention import FlashInferAttention

    dev, D, batch, width = torch.device("cuda"), 128, 64, 2**19 // BS
    fi = FlashInferAttention(
        H, KVH, D, BS, torch.bfloat16, torch.bfloat16, dev, width, D**-0.5, 0, batch, deterministic=True
    )
    if not fi.fa3:
        pytest.skip(f"{torch.cuda.get_device_name()} prefills with FA2, which has no token index")
    torch.manual_seed(0)
    cache = torch.randn(BLOCKS + 1, 2, BS, KVH, D, device=dev, dtype=torch.bfloat16)
    table = np.resize(np.random.default_rng(0).permutation(BLOCKS), width)
    reqs = [
        (table, width * BS - 1, torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)) for _ in range(batch)
    ]
    assert batch * width * BS > 16 * 2**20
    graph = attend(fi, cache, reqs, decode_only=True, graph=True)
    assert fi._graph_prefill(batch)._vector_sparse_indices_buffer.numel() >= batch * width * BS
    eager = attend(fi, cache, reqs, decode_only=True)
    assert all(torch.equal(g, e) for g, e in zip(graph, eager, strict=True))
