"""Embeddings on CUDA (runner pooling): FlashInfer attention at head dim 64, a prompt chunked over steps,
and a prompt served from the prefix cache, whose one new token runs as a CUDA-graph decode step (its
hidden state is read from the graph's output buffer)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln import LLM
from tests.models.tiny import build

PROMPTS = [list(range(10, 70)), [7, 8, 9], list(range(100, 190))]


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_embeddings_match_transformers_chunked_and_cached(tmp_path: Path, kind: str) -> None:
    hf = build("llama", tmp_path, head_dim=64).cuda()
    options = {"dtype": "bfloat16", "device": "cuda", "mode": "cudagraph", "kv_cache_gib": 0.05}
    llm = LLM(str(tmp_path), runner="pooling", pooler_config={"pooling_type": kind},
              long_prefill_token_threshold=16, **options)  # fmt: skip
    for _ in range(2):  # the second round: LAST reads the prefix cache, MEAN must not
        outs = llm.embed(PROMPTS, use_tqdm=False)
        for ids, out in zip(PROMPTS, outs, strict=True):
            with torch.no_grad():
                h = hf.model(torch.tensor([ids], device="cuda")).last_hidden_state[0].float()
            want = F.normalize(h[-1] if kind == "LAST" else h.mean(0), dim=-1).cpu()
            got = torch.tensor(out.outputs.embedding)
            assert F.cosine_similarity(got, want, dim=0) > 0.999
    hits = llm.engine.block_manager.prefix_hits
    assert hits > 0 if kind == "LAST" else hits == 0
