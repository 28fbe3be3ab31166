"""Each captured decode graph replays what the eager forward computes on the same step."""

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln import LLM, SamplingParams
from tests.models.tiny import build


@pytest.mark.parametrize("head_dim", [16, 128], ids=["torch-attention", "flashinfer"])
@torch.inference_mode()  # as the engine's steps: the graphs' static buffers are inference tensors
def test_cudagraph_replay_equals_eager_for_every_decode_bucket(head_dim: int, tmp_path: Path) -> None:
    build("llama", tmp_path, head_dim if head_dim != 16 else None)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", mode="cudagraph", kv_cache_gib=0.05,
              max_num_seqs=16, max_model_len=256)  # fmt: skip
    runner = llm.engine.runner
    graphs = runner.lowering.graphs
    assert graphs is not None and sorted(graphs.captured) == [1, 2, 4, 8, 16]
    # Every graph's inputs are views of one set of buffers, which each replay below refills.
    tables = {g.inputs[-1].untyped_storage().data_ptr() for g in graphs.captured.values()}
    assert len(tables) == 1
    # FlashInfer's kernels read the pages plan() gave them: the graphs' table is a 2-column stand-in.
    width = 2 if head_dim == 128 else runner.buf.block_table.shape[1]
    assert {g.inputs[-1].shape[1] for g in graphs.captured.values()} == {width}
    if head_dim == 128:  # and every wrapper stages its plans in one pinned buffer, which the replays reuse
        a = runner.model.attention
        staged = {w._pin_memory_int_workspace_buffer for w in [a.prefill, a.decode, *a.graph_decode.values()]}
        assert {t.data_ptr() for t in staged} == {a.pinned_int_workspace.data_ptr()}
    rng = np.random.default_rng(0)
    for cache in runner.kv_caches:  # a random context for every block
        cache.copy_(torch.randn_like(cache, dtype=torch.float32))
    buckets = sorted(graphs.captured)
    for smaller, bucket in zip([0, *buckets], buckets, strict=False):
        for n in {bucket, smaller + 1}:  # a full bucket, and the fewest rows it takes (the rest padding)
            lens = rng.integers(1, 200, n)
            runner.buf.input_ids[:n] = rng.integers(0, 256, n)
            runner.buf.positions[:n] = lens - 1
            runner.buf.slot_mapping[
                :n
            ] = -1  # write into the padding block only: both runs see the same cache
            runner.buf.query_start_loc[: n + 1] = np.arange(n + 1)
            runner.buf.seq_lens[:n] = lens
            width = runner.buf.block_table.shape[1]
            for row in range(n):  # through set_blocks, which keeps track of what each row holds
                runner.buf.set_blocks(row, rng.permutation(runner.buf.padding_block)[:width].tolist())
            num_tokens, args = runner.step_inputs(n, n, True)
            assert num_tokens == bucket
            replayed = runner.lowering(num_tokens, True, *args)[:n].clone()
            with torch.compiler.set_stance("force_eager"):
                eager = runner.model(*args)[:n]
            torch.testing.assert_close(
                replayed, eager, atol=3e-2, rtol=3e-2, msg=f"bucket {bucket}, {n} rows"
            )
            logits = runner.model.compute_logits
            assert torch.equal(logits(replayed).argmax(-1), logits(eager).argmax(-1)), f"bucket {bucket}"


def test_torch_moe_experts_run_compiled_not_captured(tmp_path: Path) -> None:
    """torch's MoE reference groups tokens by expert on the host, which a capture refuses: mode auto runs
    compiled (and generates), and an explicit cudagraph is a config error that says why."""
    build("qwen3_moe", tmp_path, 128)
    options = {
        "dtype": "bfloat16",
        "device": "cuda",
        "kernels": "torch",
        "kv_cache_gib": 0.05,
        "max_num_seqs": 4,
    }
    llm = LLM(str(tmp_path), **options)
    assert (llm.engine.runner.lowering.mode, llm.engine.runner.lowering.graphs) == ("compiled", None)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert (
        len(llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy, use_tqdm=False)[0].outputs[0].token_ids)
        == 4
    )
    del llm
    with pytest.raises(ValueError, match="'torch' runs MoE experts through the host"):
        LLM(str(tmp_path), mode="cudagraph", **options)
