"""Embeddings from a pooling model (runner "pooling", kiln.engine.pooler): each pooling type against
transformers' own final hidden states, over prompts chunked across steps, served from the prefix cache
and batched together; dimensions, use_activation, sentence-transformers folders, and the errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from kiln.llm import LLM
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams
from tests.models.tiny import CONFIGS, build, save_tokenizer

# A 16-token prefill chunk puts the long prompts across several steps; async scheduling finishes each
# embedding request at its launch, before its vector lands.
OPTIONS = {
    "dtype": "float32",
    "max_model_len": 128,
    "kv_cache_gib": 0.02,
    "enforce_eager": True,
    "long_prefill_token_threshold": 16,
    "async_scheduling": True,
}
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 70)), [7], list(range(200, 255)) + list(range(0, 73))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("pooled-llama")
    return path, build("llama", path)


@pytest.fixture(scope="module")
def last(tiny: tuple[Path, torch.nn.Module]) -> Iterator[LLM]:
    yield LLM(str(tiny[0]), runner="pooling", **OPTIONS)


def hidden(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


def embeddings(llm: LLM, prompts: list[list[int]], params: PoolingParams | None = None) -> list[torch.Tensor]:
    outs = llm.embed(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts and all(o.finished for o in outs)
    return [torch.tensor(o.outputs.embedding) for o in outs]


def test_last_token_pooling_is_transformers_last_hidden_state_normalized(
    last: LLM, tiny: tuple[Path, torch.nn.Module]
) -> None:
    got = embeddings(last, PROMPTS)
    for ids, v in zip(PROMPTS, got, strict=True):
        torch.testing.assert_close(v, F.normalize(hidden(tiny[1], ids)[-1], dim=-1), atol=1e-5, rtol=1e-5)
    # Again, from the prefix cache (all but the last token), and one by one: the same vectors.
    for ids, v in zip(PROMPTS, got, strict=True):
        [again] = embeddings(last, [ids])
        torch.testing.assert_close(again, v, atol=1e-6, rtol=1e-6)
    assert last.engine.block_manager.prefix_hits > 0


def test_use_activation_false_gives_the_raw_hidden_state(
    last: LLM, tiny: tuple[Path, torch.nn.Module]
) -> None:
    [v] = embeddings(last, [PROMPTS[1]], PoolingParams(use_activation=False))
    torch.testing.assert_close(v, hidden(tiny[1], PROMPTS[1])[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_mean_and_first_token_pooling_over_chunks_and_a_cached_prefix(
    kind: str, tiny: tuple[Path, torch.nn.Module]
) -> None:
    llm = LLM(str(tiny[0]), runner="pooling", pooler_config={"pooling_type": kind}, **OPTIONS)
    for _ in range(2):  # the second round finds every prompt's blocks cached, and must not use them
        got = embeddings(llm, PROMPTS)
        for ids, v in zip(PROMPTS, got, strict=True):
            h = hidden(tiny[1], ids)
            want = h.mean(0) if kind == "MEAN" else h[0]
            torch.testing.assert_close(v, F.normalize(want, dim=-1), atol=1e-5, rtol=1e-5)
    assert llm.engine.block_manager.prefix_hits == 0


def test_an_embedding_may_fill_max_model_len_and_no_more(last: LLM) -> None:
    [v] = embeddings(last, [list(range(128))])
    assert v.shape == (64,)
    with pytest.raises(ValueError, match="prompt has 129 tokens, more than max_model_len=128"):
        last.embed([list(range(129))], use_tqdm=False)


def test_each_runner_refuses_the_other_kind_of_request(last: LLM, tiny: tuple[Path, torch.nn.Module]) -> None:
    with pytest.raises(ValueError, match="does not generate"):
        last.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    generating = LLM(str(tiny[0]), runner="generate", **OPTIONS)
    with pytest.raises(ValueError, match="--runner pooling"):
        generating.embed([[1, 2]], use_tqdm=False)
    converted = LLM(str(tiny[0]), convert="embed", **OPTIONS)  # vLLM's other spelling of runner pooling
    assert embeddings(converted, [PROMPTS[0]])[0].tolist() == embeddings(last, [PROMPTS[0]])[0].tolist()


def test_dimensions_need_a_matryoshka_model(last: LLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        last.embed([[1, 2]], PoolingParams(dimensions=8), use_tqdm=False)
    model = build("llama", tmp_path, matryoshka_dimensions=[16, 32])
    llm = LLM(str(tmp_path), runner="pooling", **OPTIONS)
    [v] = embeddings(llm, [PROMPTS[1]], PoolingParams(dimensions=16))
    torch.testing.assert_close(
        v, F.normalize(hidden(model, PROMPTS[1])[-1][:16], dim=-1), atol=1e-5, rtol=1e-5
    )
    with pytest.raises(
        ValueError, match=r"dimensions must be one of the model's Matryoshka dimensions \[16, 32\]"
    ):
        llm.embed([[1, 2]], PoolingParams(dimensions=8), use_tqdm=False)


def test_a_sentence_transformers_folder_is_served_for_embeddings_as_it_says(tmp_path: Path) -> None:
    model = build("qwen3", tmp_path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
        },
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    settings = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
    }
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(settings))
    llm = LLM(str(tmp_path), **OPTIONS)  # runner auto: pooling, MEAN, and no Normalize module
    [v] = embeddings(llm, [PROMPTS[1]])
    torch.testing.assert_close(v, hidden(model, PROMPTS[1]).mean(0), atol=1e-5, rtol=1e-5)

    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"sentence_transformers\.models\.Dense is not supported"):
        LLM(str(tmp_path), **OPTIONS)


def test_score_is_the_cosine_of_the_embeddings_one_to_many_and_pairwise(last: LLM) -> None:
    texts = ["t1 t2 t3", "t9 t8", "t4 t4 t4 t4", "t200"]
    vectors = [torch.tensor(o.outputs.embedding) for o in last.embed(texts, use_tqdm=False)]
    for first, second in ((texts[:1], texts[1:]), (texts[:2], texts[2:])):
        outs = last.score(first, second, use_tqdm=False)
        a = [vectors[texts.index(t)] for t in first] * (len(second) if len(first) == 1 else 1)
        b = [vectors[texts.index(t)] for t in second]
        want = [F.cosine_similarity(x, y, dim=0).item() for x, y in zip(a, b, strict=True)]
        assert [o.outputs.score for o in outs] == pytest.approx(want, abs=1e-5)
        assert all(o.finished for o in outs) and len(outs[0].prompt_token_ids) == 3 + len(second[0].split())
    with pytest.raises(ValueError, match="Input lengths must be either 1:1, 1:N or N:N"):
        last.score(texts[:2], texts[1:], use_tqdm=False)


def test_backbones_saved_without_their_head_are_embedding_models(tmp_path: Path) -> None:
    hf = build("qwen3", tmp_path / "causal", tie_word_embeddings=True)
    ids = PROMPTS[1]
    want = F.normalize(hidden(hf, ids)[-1], dim=-1)
    # transformers' own save of the backbone: Qwen3Model, its tensors without "model.".
    hf.model.save_pretrained(tmp_path / "backbone")
    save_tokenizer(tmp_path / "backbone")
    [v] = embeddings(LLM(str(tmp_path / "backbone"), **OPTIONS), [ids])  # runner auto: pooling
    torch.testing.assert_close(v, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="without its LM head"):
        LLM(str(tmp_path / "backbone"), runner="generate", **OPTIONS)
    # As Qwen3-Embedding ships: a Qwen3ForCausalLM config over the backbone's tensors, no lm_head.
    flat = tmp_path / "flat"
    shutil.copytree(tmp_path / "backbone", flat)
    config = json.loads((tmp_path / "causal" / "config.json").read_text())
    (flat / "config.json").write_text(json.dumps(config))
    [v] = embeddings(LLM(str(flat), runner="pooling", **OPTIONS), [ids])
    torch.testing.assert_close(v, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_a_sequence_classifier_gives_transformers_class_probabilities(tmp_path: Path, name: str) -> None:
    config_cls, kwargs = CONFIGS[name]
    config = getattr(transformers, config_cls)(
        **kwargs, num_labels=3, id2label={0: "no", 1: "maybe", 2: "yes"}
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), **OPTIONS)  # runner auto: pooling, task classify
    outs = llm.classify(PROMPTS, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(torch.tensor(out.outputs.probs), logits.softmax(-1), atol=1e-5, rtol=1e-5)
    assert llm.engine.pooler is not None and llm.engine.pooler.labels == ("no", "maybe", "yes")
    with pytest.raises(ValueError, match="--runner pooling"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="sequence classifier"):
        LLM(str(tmp_path), runner="generate", **OPTIONS)
