"""Async scheduling (vLLM's, CUDA's default): each step is launched before the last one's tokens are
processed, its decode inputs read from the device. On the CPU it runs the same code with nothing to
overlap, so here it must give the same outputs as scheduling one step at a time, however requests end."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from kiln.engine.engine import LLMEngine
from kiln.engine.request_output import RequestOutput
from kiln.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

OPTIONS = {"dtype": "float32", "max_model_len": 256, "kv_cache_gib": 0.05, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def engines(default_model_dir: Path) -> dict[bool, LLM]:
    return {a: LLM(str(default_model_dir), async_scheduling=a, **OPTIONS) for a in (False, True)}


def whole(out: RequestOutput) -> list[tuple]:
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
        for c in out.outputs
    ] + [out.prompt_logprobs]


def test_every_way_of_ending_matches_sync_scheduling(engines: dict[bool, LLM]) -> None:
    llm = engines[True]
    tok = llm.get_tokenizer()
    chat = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    text = tok.encode("The history of the lighthouse begins in the ancient world, when fires were lit")
    once = tok.encode("Once upon a time")
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    first = llm.generate([text], greedy, use_tqdm=False)[0].outputs[0]
    cases = [
        (chat, greedy),  # ends at EOS
        (chat, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=12)),  # EOS banned for 12
        (text, SamplingParams(temperature=0.0, max_tokens=40, stop=[tok.decode(first.token_ids[5:7])])),
        (text, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[first.token_ids[3]])),
        (text, SamplingParams(temperature=0.0, max_tokens=1)),
        (text, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2, prompt_logprobs=1)),
        (chat, SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=30, repetition_penalty=1.3)),
        (text, SamplingParams(temperature=0.7, seed=3, max_tokens=20, presence_penalty=1.0, top_k=20)),
        (text[:5], SamplingParams(temperature=0.0, max_tokens=256)),  # ends at max_model_len
        # A two-token bad word reads the last token on the host: the next step lands it first.
        (once, SamplingParams(temperature=0.0, max_tokens=20, bad_words=["Nova Haven"])),
    ]
    prompts, params = [p for p, _ in cases], [q for _, q in cases]
    sync, pipelined = (engines[a].generate(prompts, params, use_tqdm=False) for a in (False, True))
    reasons = [c.finish_reason for out in sync for c in out.outputs]
    assert reasons.count("stop") >= 4 and reasons.count("length") >= 3
    for s, p in zip(sync, pipelined, strict=True):
        assert whole(p) == whole(s)
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.usage == 0.0


def steps_until_done(engine: LLMEngine) -> tuple[int, list[RequestOutput]]:
    steps, outputs = 0, []
    while engine.has_unfinished():
        outputs += engine.step()
        steps += 1
    return steps, outputs


def test_outputs_come_a_step_late_and_no_step_is_wasted_on_a_length_stop(engines: dict[bool, LLM]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    counts = {}
    for a, llm in engines.items():
        llm.engine.add_request("late", [1, 2, 3, 4], params)
        steps, outputs = steps_until_done(llm.engine)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * 5
        counts[a] = steps
    # Prefill and four decodes launched either way; the async engine lands the last one a step later.
    assert counts == {False: 5, True: 6}


def test_a_request_aborted_while_its_step_runs_gets_nothing_more(engines: dict[bool, LLM]) -> None:
    engine = engines[True].engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("kept", [5, 6, 7, 8], params)
    engine.add_request("gone", [9, 10, 11, 12], params)
    outputs = engine.step() + engine.step() + engine.step()
    assert engine.in_flight is not None
    assert {r.request_id for r in engine.in_flight.sampled} == {"kept", "gone"}
    engine.abort("gone")
    _, rest = steps_until_done(engine)
    assert "gone" not in {o.request_id for o in rest}
    kept = [t for o in outputs + rest if o.request_id == "kept" for t in o.outputs[0].token_ids]
    alone = engines[False].generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
    assert kept == alone.token_ids
    assert engine.block_manager.usage == 0.0


def test_grammar_rows_land_mid_step_and_match_sync_scheduling(engines: dict[bool, LLM]) -> None:
    """Under a grammar, the last step's tokens land after this step's forward is launched and before its
    rows are sampled (their bitmasks need them): outputs equal one step at a time's, when a grammar ends a
    request, when one ends beside free rows, and after a stop string ends a constrained one."""
    llm = engines[True]
    ask = llm.apply_chat_template([{"role": "user", "content": "When was the Eiffel tower built?"}])
    date = StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}")
    year = StructuredOutputsParams(choice=["1887", "1889"])
    schema = {"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"]}
    json = StructuredOutputsParams(json=schema)
    params = [
        SamplingParams(temperature=0.0, max_tokens=24),  # free, beside the grammar rows
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=24, structured_outputs=date),
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=year),
        SamplingParams(temperature=0.0, max_tokens=24, stop=["-"], structured_outputs=date),
        SamplingParams(temperature=0.7, seed=5, max_tokens=40, logprobs=1, structured_outputs=json),
    ]
    prompts = [ask] * len(params)
    sync, pipelined = (engines[a].generate(prompts, params, use_tqdm=False) for a in (False, True))
    for s, p in zip(sync, pipelined, strict=True):
        assert whole(p) == whole(s)
    texts = [c.text for out in pipelined for c in out.outputs]
    assert texts[4] in ("1887", "1889") and "-" not in texts[5] and '"year"' in texts[6]
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.usage == 0.0
