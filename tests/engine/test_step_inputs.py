"""An attention that plans from the host's block table (FlashInfer) gets a fixed two-column stand-in on the
device rather than a copy of every row's blocks each step, and computes what a table-reading one does."""

from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import torch

from kiln.config import EngineConfig
from kiln.engine.runner import ModelRunner
from kiln.models.loader import load_model
from kiln.ops.attention import AttentionImpl, AttnMetadata, StepLayout
from kiln.ops.torch_attention import TORCH_ATTENTION, TorchAttention
from tests.models.tiny import build


class HostPlanned(TorchAttention):
    """FlashInfer's contract, on the CPU: plan() keeps the step's pages from the host's table, and forward
    reads those, never meta.block_table."""

    reads_block_table = False

    def plan(self, layout: StepLayout) -> None:
        self.table = torch.from_numpy(layout.block_table.copy())

    def forward(self, q, k, v, kv_cache, meta: AttnMetadata, scale, sliding_window) -> torch.Tensor:
        assert meta.block_table.shape[1] == 2 and not meta.block_table.any()
        return super().forward(
            q, k, v, kv_cache, replace(meta, block_table=self.table), scale, sliding_window
        )


def runner(path: Path, attention: AttentionImpl) -> ModelRunner:
    config = EngineConfig.from_options(str(path), mode="eager", max_num_seqs=8, max_model_len=128)
    config = msgspec.structs.replace(
        config, cache=config.cache.on("cpu"), scheduler=config.scheduler.on("cpu")
    )
    r = ModelRunner(load_model(path, "float32", attention=attention), config, 128)
    r.allocate_kv(64)
    return r


@torch.inference_mode()
def test_a_host_planned_attention_reads_no_device_table_and_matches(tmp_path: Path) -> None:
    build("llama", tmp_path)
    reference, planned = runner(tmp_path, TORCH_ATTENTION), runner(tmp_path, HostPlanned())
    assert reference.no_table is None and planned.no_table is not None
    rng = np.random.default_rng(0)
    for cache, other in zip(reference.kv_caches, planned.kv_caches, strict=True):
        cache.copy_(torch.randn_like(cache))
        other.copy_(cache)
    for q_lens in ([1, 1, 1, 1, 1], [5, 1, 9]):  # a decode step, a mixed one
        contexts = rng.integers(10, 100, len(q_lens))
        tokens = rng.integers(0, 256, sum(q_lens))
        outputs = [step(r, q_lens, contexts, tokens) for r in (reference, planned)]
        assert torch.equal(*outputs), q_lens


def step(r: ModelRunner, q_lens: list[int], contexts: np.ndarray, tokens: np.ndarray) -> torch.Tensor:
    buf, cu = r.buf, np.cumsum([0, *q_lens])
    buf.input_ids[: cu[-1]] = tokens
    buf.positions[: cu[-1]] = np.concatenate(
        [np.arange(c - q, c) for c, q in zip(contexts, q_lens, strict=True)]
    )
    buf.slot_mapping[: cu[-1]] = -1  # writes land in the padding block: the two caches stay alike
    buf.query_start_loc[: len(q_lens) + 1] = cu
    buf.seq_lens[: len(q_lens)] = contexts
    for row in range(len(q_lens)):
        buf.set_blocks(row, np.random.default_rng(row).permutation(64)[: buf.block_table.shape[1]].tolist())
    num_tokens, args = r.step_inputs(int(cu[-1]), len(q_lens), all(q == 1 for q in q_lens))
    return r.model(*args)[:num_tokens]
