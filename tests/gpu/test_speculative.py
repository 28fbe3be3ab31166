"""Speculative decoding (prompt lookup) on CUDA: a decoding request's drafts go through FlashInfer's prefill
path and the CUDA sampler's rows, and its greedy outputs equal decoding one token a step. Both run
batch-invariant (deterministic): a step of drafts is a mixed step, not a decode graph."""

from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from tests.models.tiny import build

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("head_dim", [16, 128])
def test_drafted_greedy_outputs_match_one_token_a_step(head_dim: int, tmp_path: Path) -> None:
    build("llama", tmp_path, head_dim)
    options = {"dtype": "bfloat16", "device": "cuda", "deterministic": True, "kv_cache_gib": 0.05,
               "max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 64}  # fmt: skip
    plain = LLM(str(tmp_path), **options)
    drafted = LLM(str(tmp_path), speculative_config=SPEC, **options)
    assert not drafted.engine.async_scheduling
    loop = [5, 6, 7, 8, 9] * 8
    prompts = [{"prompt_token_ids": loop[i:]} for i in range(6)]
    words = [5, 6, 7, 8, 9]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, allowed_token_ids=words),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, allowed_token_ids=words, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=7, allowed_token_ids=words, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, allowed_token_ids=words),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]

    def whole(llm: LLM) -> list:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]

    assert whole(drafted) == whole(plain)
    drafts = drafted.engine.drafts
    assert drafts is not None and drafts.num_accepted_tokens > 0
    assert drafted.engine.block_manager.usage == 0.0 and not drafted.engine.has_unfinished()
