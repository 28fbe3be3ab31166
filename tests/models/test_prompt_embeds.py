"""Prompts given as embeddings (enable_prompt_embeds): kiln's greedy tokens against transformers' generate
from the same inputs_embeds; how they share the prefix cache; what is refused."""

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.models.tiny import build

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "gpt2"])  # rotary, and learned positions added after
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LLM, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, path)
    # Chunks of 32 tokens: the 40-row prompt takes two steps, the second beside other prompts' decodes.
    llm = LLM(
        str(path), dtype="float32", kv_cache_gib=0.01, max_num_batched_tokens=32, enable_prompt_embeds=True
    )
    return llm, hf


def embeds(n: int, hf: torch.nn.Module, seed: int) -> torch.Tensor:
    """Rows that are no token's embedding, at the embeddings' scale."""
    weight = hf.get_input_embeddings().weight
    return torch.randn(n, weight.shape[1], generator=torch.Generator().manual_seed(seed)) * weight.std()


def reference(hf: torch.nn.Module, rows: torch.Tensor, max_tokens: int = 16, **options: float) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            inputs_embeds=rows[None], do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            pad_token_id=0, **options,
        )  # fmt: skip
    return out[0].tolist()  # (only the new tokens, given embeddings alone)


def tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_tokens_match_transformers(tiny: tuple[LLM, torch.nn.Module]) -> None:
    """Prompts of 1, 5, 13 and 40 rows in one batch with a token-id prompt, chunked by 32; the lone
    one-row prompt runs as a decode step."""
    llm, hf = tiny
    rows = [embeds(n, hf, seed) for seed, n in enumerate((5, 13, 40))]
    ids = [3, 14, 15, 92, 65, 35]
    batch = [{"prompt_embeds": rows[0]}, ids, {"prompt_embeds": rows[1]}, {"prompt_embeds": rows[2]}]
    got = tokens(llm, batch)
    with torch.no_grad():
        by_ids = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=16)
    assert got == [
        reference(hf, rows[0]),
        by_ids[0, len(ids) :].tolist(),
        *map(reference, [hf] * 2, rows[1:]),
    ]
    one = embeds(1, hf, 7)
    assert tokens(llm, [{"prompt_embeds": one}]) == [reference(hf, one)]


def test_a_tokens_own_embedding_is_that_token(tiny: tuple[LLM, torch.nn.Module]) -> None:
    """The rows of the embedding matrix, as a (1, tokens, hidden) batch of one, generate what the ids do;
    rows in bfloat16 are cast to the model's float32."""
    llm, hf = tiny
    ids = [7, 1, 200, 54, 9, 33, 120]
    rows = hf.get_input_embeddings().weight[ids].detach()
    assert tokens(llm, [{"prompt_embeds": rows[None]}]) == tokens(llm, [ids])
    out = llm.generate({"prompt_embeds": rows.to(torch.bfloat16)}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(hf, rows.to(torch.bfloat16).float())
    assert out.prompt is None and out.prompt_token_ids == [0] * len(ids)


def test_the_prefix_cache_keys_by_the_rows(tiny: tuple[LLM, torch.nn.Module]) -> None:
    """A prompt that shares its first 32 rows (one block) with an earlier one reuses that block; one whose
    rows differ, or a token-id prompt of the placeholder ids, reuses nothing."""
    llm, hf = tiny
    llm.reset_prefix_cache()
    first = embeds(40, hf, 11)
    shared = torch.cat([first[:32], embeds(8, hf, 12)])
    other = embeds(40, hf, 13)
    outs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in (
        {"prompt_embeds": first}, {"prompt_embeds": shared}, {"prompt_embeds": other}, [0] * 40,
    )]  # fmt: skip
    assert [o.num_cached_tokens for o in outs] == [0, 32, 0, 0]
    assert outs[1].outputs[0].token_ids == reference(hf, shared)


def test_truncation_and_penalties(tiny: tuple[LLM, torch.nn.Module]) -> None:
    """truncate_prompt_tokens keeps the last rows; a repetition penalty counts the output alone (an
    embeddings prompt has no tokens), as transformers' does."""
    llm, hf = tiny
    rows = embeds(20, hf, 21)
    kept = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, truncate_prompt_tokens=8)
    out = llm.generate({"prompt_embeds": rows}, kept, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 8 and out.outputs[0].token_ids == reference(hf, rows[-8:])
    penalized = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=2.0)
    got = tokens(llm, [{"prompt_embeds": rows}], penalized)
    assert got == [reference(hf, rows, repetition_penalty=2.0)] and got != tokens(
        llm, [{"prompt_embeds": rows}]
    )


def test_what_is_refused(tiny: tuple[LLM, torch.nn.Module], tmp_path: Path) -> None:
    llm, hf = tiny
    hidden = hf.get_input_embeddings().weight.shape[1]
    bad = {
        "hidden_size 65 does not match the model's hidden_size": torch.zeros(3, hidden + 1),
        "must be a 2D tensor": torch.zeros(2, 3, hidden),
        "is not a floating-point type": torch.zeros(3, hidden, dtype=torch.int64),
        "prompt is empty": torch.zeros(0, hidden),
        "leaves no room to generate": torch.zeros(256, hidden),
    }
    for message, rows in bad.items():
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt_embeds": rows}, GREEDY, use_tqdm=False)
    logprobs = SamplingParams(max_tokens=2, prompt_logprobs=1)
    with pytest.raises(ValueError, match="prompt_logprobs is not compatible with prompt embeds"):
        llm.generate({"prompt_embeds": torch.zeros(3, hidden)}, logprobs, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    path = tmp_path / "off"
    build("llama", path)
    off = LLM(str(path), kv_cache_gib=0.01, mode="eager")
    with pytest.raises(ValueError, match="You must set `--enable-prompt-embeds`"):
        off.generate({"prompt_embeds": torch.zeros(3, hidden)}, GREEDY, use_tqdm=False)
