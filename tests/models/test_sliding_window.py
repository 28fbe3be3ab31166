"""--disable-sliding-window (vLLM's): a sliding-window model attends to its whole context, which is capped
at the window; the tiny Mistral's window is 16 tokens."""

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.models.tiny import build


def test_full_attention_within_the_window(tmp_path: Path) -> None:
    """Capped at 16, a 6-token prompt and 9 new tokens: transformers' tokens with full attention, equal to
    the windowed model's (the window never cuts within 16 tokens)."""
    hf = build("mistral", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_gib=0.01, mode="eager", disable_sliding_window=True)
    assert llm.engine.max_model_len == 16 and llm.engine.model.dims.sliding_window == 0
    prompt = [3, 14, 15, 92, 65, 35]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=9, min_new_tokens=9)
    assert out[0].outputs[0].token_ids == ref[0, len(prompt) :].tolist()
    with pytest.raises(ValueError, match=r"max_model_len 32 exceeds the model's sliding_window \(--disable"):
        LLM(str(tmp_path), max_model_len=32, disable_sliding_window=True, kv_cache_gib=0.01, mode="eager")
