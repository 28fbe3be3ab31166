"""The model forward traces under torch.compile(fullgraph=True) and gives eager's greedy tokens."""

from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from tests.models.test_architectures import PROMPTS
from tests.models.tiny import build


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gpt2"])
def test_compiled_matches_eager(arch: str, tmp_path: Path) -> None:
    build(arch, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for mode in ("eager", "compiled"):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_gib=0.01, max_num_batched_tokens=32, mode=mode)
        runs[mode] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert runs["compiled"] == runs["eager"]
