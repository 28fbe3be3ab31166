"""Async scheduling on CUDA (its default there): the step after is launched before a step's tokens reach the
host, reads its decode inputs from the sampled tokens on the device, and FlashInfer plans it while the
last one runs. Its outputs must equal one-step-at-a-time scheduling's, token for token, however requests
end. Both run batch-invariant (deterministic), as a stop seen a step late adds a row to the next step."""

import random
from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.models.tiny import VOCAB, build


def whole(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[tuple]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        [(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] + [o.prompt_logprobs]
        for o in outs
    ]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_async_scheduling_matches_sync_scheduling(head_dim: int, tmp_path: Path) -> None:
    build("llama", tmp_path, head_dim)
    options = {"dtype": "bfloat16", "device": "cuda", "deterministic": True, "kv_cache_gib": 0.05,
               "max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 64}  # fmt: skip
    pipelined = LLM(str(tmp_path), **options)
    assert pipelined.engine.async_scheduling, "CUDA's default"
    sync = LLM(str(tmp_path), async_scheduling=False, **options)

    rng = random.Random(head_dim)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (5, 40, 150, 7, 90, 12, 3, 60)]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    first = whole(sync, prompts[:1], [greedy])[0][0][0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[first[4]]),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[first[4]], min_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, max_tokens=20, presence_penalty=1, top_k=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True),  # ends at max_model_len
        greedy,
    ]
    prompts[0] = prompts[1] = prompts[0]  # the stop token comes at the fifth step of the first
    expected = whole(sync, prompts, params)
    assert whole(pipelined, prompts, params) == expected
    assert pipelined.engine.block_manager.usage == 0.0 and not pipelined.engine.has_unfinished()


@pytest.mark.parametrize("deterministic", [False, True])
def test_steps_never_synchronize_the_stream(deterministic: bool, tmp_path: Path) -> None:
    """A call that synchronizes the stream anywhere in a step (a blocking copy to the device, reading a value
    off it) holds the host until the GPU has run everything queued, so async scheduling would overlap
    nothing. torch's sync debug mode makes every such call raise; waiting on a step's event is not one."""
    build("llama", tmp_path, 128)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", deterministic=deterministic, kv_cache_gib=0.05,
              max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)  # fmt: skip
    rng = random.Random(1)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (5, 40, 150, 7, 90, 12)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.1, seed=2, max_tokens=12, ignore_eos=True),
        SamplingParams(
            temperature=0.9,
            n=2,
            seed=3,
            max_tokens=12,
            ignore_eos=True,
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            logit_bias={7: 3.0},
        ),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True),  # the engine's own generator
    ]
    expected = whole(llm, prompts, params)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = whole(llm, prompts, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [[len(c[0]) for c in o[:-1]] for o in got] == [[12] * p.n for p in params]
    if deterministic:  # batch-invariant, so the prefix cache's hits the second time change no token
        assert got[:-1] == expected[:-1]  # the last, unseeded, draws other tokens the second time
