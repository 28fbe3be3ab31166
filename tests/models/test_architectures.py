"""Every supported architecture against transformers' own implementation, in fp32."""

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.models.loader import load_model
from kiln.ops.attention import AttnMetadata
from tests.models.tiny import CONFIGS, VOCAB, build

PROMPTS = [
    [int(t) for t in torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n))]
    for n in (5, 13, 40)
]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    return path, build(request.param, path)


def test_prefill_logits_match(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, hf = tiny
    model = load_model(path, "float32")
    ids = torch.tensor(PROMPTS[2])
    block_size, num_blocks = 16, 4
    d = model.dims
    caches = [torch.zeros(num_blocks, 2, block_size, d.num_kv_heads, d.head_dim) for _ in range(d.num_layers)]
    n = len(ids)
    meta = AttnMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.arange(num_blocks, dtype=torch.int32)[None],
    )
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(n), caches, meta))
        expected = hf(ids[None]).logits[0]
    rel = ((logits - expected).norm() / expected.norm()).item()
    assert rel < 1e-4, rel


def test_greedy_tokens_match(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, hf = tiny
    llm = LLM(str(path), dtype="float32", kv_cache_gib=0.01, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32, pad_token_id=0
            )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
