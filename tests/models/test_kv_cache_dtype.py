"""--kv-cache-dtype fp8: kiln against transformers with the same rounding of K and V (stored at a scale of
1.0, saturating), on the CPU kernel and the torch reference; and what the smaller cache holds."""

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from kiln import LLM, SamplingParams
from kiln.engine.memory import GIB
from kiln.ops.attention import to_cache
from tests.models.test_architectures import PROMPTS
from tests.models.tiny import build

pytestmark = pytest.mark.slow

KV_CACHE_GIB = 0.01


class RoundingCache(DynamicCache):
    """transformers' cache with every new K and V rounded to `dtype` and back: attention then reads what
    kiln's cache holds, for the new tokens too (kiln reads them back from its cache)."""

    def __init__(self, dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dtype = dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        k, v = (to_cache(x, self.dtype).to(x.dtype) for x in (key_states, value_states))
        return super().update(k, v, *args, **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("llama")
    return path, build("llama", path)


@pytest.mark.parametrize(
    ("name", "dtype", "attention"),
    [("fp8", torch.float8_e4m3fn, "cpu"), ("fp8_e5m2", torch.float8_e5m2, "torch")],
)
def test_greedy_tokens_match_transformers_rounding_alike(
    tiny: tuple[Path, torch.nn.Module], name: str, dtype: torch.dtype, attention: str
) -> None:
    """Prompts of 5, 13 and 40 tokens (chunked by 32), 32 tokens each: kiln's, and the reference's with K
    and V rounded as kiln stores them; a float32 cache would differ from both. The cache takes a quarter of
    float32's bytes per block, so the same memory holds four times the blocks."""
    path, hf = tiny
    llm = LLM(
        str(path), dtype="float32", kv_cache_gib=KV_CACHE_GIB, max_num_batched_tokens=32,
        kv_cache_dtype=name, attention=attention,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    unrounded = []
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        greedy = {"do_sample": False, "max_new_tokens": 32, "min_new_tokens": 32, "pad_token_id": 0}
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), cache=RoundingCache(dtype, config=hf.config), **greedy)
            plain = hf.generate(torch.tensor([prompt]), **greedy)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
        unrounded.append(plain[0, len(prompt) :].tolist())
    assert unrounded != [out.outputs[0].token_ids for out in outputs]  # the rounding shows
    runner = llm.engine.runner
    assert {c.dtype for c in runner.kv_caches} == {dtype}
    d = llm.engine.model.dims
    block_bytes = d.num_layers * 2 * runner.block_size * d.num_kv_heads * d.head_dim  # one byte a value
    assert llm.engine.block_manager.num_blocks == int(KV_CACHE_GIB * GIB) // block_bytes - 1
