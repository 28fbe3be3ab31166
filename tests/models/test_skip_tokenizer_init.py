"""skip_tokenizer_init: a model folder without a tokenizer serves token ids in and token ids out, as
transformers generates them; whatever needs text is refused, naming why."""

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.sampling_params import StructuredOutputsParams
from tests.models.tiny import build

IDS = [3, 14, 15, 92, 65]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def without_tokenizer(path: Path) -> Path:
    for f in path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            f.unlink()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, torch.nn.Module]:
    path = tmp_path_factory.mktemp("no-tokenizer")
    hf = build("llama", path)
    llm = LLM(str(without_tokenizer(path)), dtype="float32", kv_cache_gib=0.01, skip_tokenizer_init=True)
    return llm, hf


def test_token_ids_in_and_out(tiny: tuple[LLM, torch.nn.Module]) -> None:
    llm, hf = tiny
    assert llm.get_tokenizer() is None
    out = llm.generate([IDS, {"prompt_token_ids": IDS[:2]}], GREEDY, use_tqdm=False)
    for o, prompt in zip(out, (IDS, IDS[:2]), strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12)
        assert o.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
        assert o.outputs[0].text == "" and o.prompt is None
    first = out[0].outputs[0].logprobs[0]
    assert {t: lp.decoded_token for t, lp in first.items()} == {t: f"token_id:{t}" for t in first}


def test_what_needs_text_is_refused(tiny: tuple[LLM, torch.nn.Module]) -> None:
    llm, _ = tiny
    refused = [
        ("You cannot pass text prompts when `skip_tokenizer_init=True`", "hello", GREEDY),
        ("^stop needs text", IDS, SamplingParams(stop=["x"])),
        ("^bad_words needs a tokenizer", IDS, SamplingParams(bad_words=["x"])),
        (
            "^Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'",
            IDS,
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")),
        ),
    ]
    for message, prompt, params in refused:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, params, use_tqdm=False)
    with pytest.raises(ValueError, match="Tokenizer not available when `skip_tokenizer_init=True`"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert not llm.engine.has_unfinished()


def test_a_config_alone_serves_dummy_weights(tmp_path: Path) -> None:
    """load_format dummy with skip_tokenizer_init: config.json is all the folder needs."""
    build("llama", tmp_path)
    for f in tmp_path.iterdir():
        if f.name != "config.json":
            f.unlink()
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, kv_cache_gib=0.01, mode="eager")
    out = llm.generate(IDS, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_a_reasoning_parser_needs_the_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"model\.reasoning_parser finds the reasoning.s tags with the tokenizer"
    ):
        LLM(str(tmp_path), skip_tokenizer_init=True, reasoning_parser="qwen3")
