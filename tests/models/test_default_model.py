"""The real default model: exact against transformers in fp32, and right in kiln's default configuration."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kiln import LLM, SamplingParams

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "My favourite recipe for a rainy day is",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return LLM(str(default_model_dir), dtype="float32")


def test_greedy_matches_transformers(llm: LLM, default_model_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, do_sample=False, max_new_tokens=48, min_new_tokens=48, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()
        assert out.outputs[0].text == tokenizer.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)


def test_capital_of_france_in_default_config() -> None:
    llm = LLM()  # the default model, the default CPU configuration
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
