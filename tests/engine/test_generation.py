"""End-to-end generation with the default model (fp32): batching, caching, sampling, stops, logprobs,
and input validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln import LLM, BeamSearchParams, SamplingParams
from kiln.config import EngineConfig
from kiln.engine.request_output import CompletionOutput, RequestOutput

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
TEXT = (
    "The history of the lighthouse begins in the ancient world, when fires were lit on hilltops to guide "
    "ships safely into harbour. Over the centuries these simple beacons grew into towers of stone and "
    "brick, and the keepers who tended them became part of the folklore of every coastal town. In the "
    "nineteenth century, engineers learned to focus the light with lenses and mirrors, so that a single "
    "lamp could be seen from more than twenty miles away. Today most lighthouses are automated, but many "
    "still stand as monuments to the people who kept them burning through storms and long winter nights, "
    "and visitors climb their spiral stairs to look out over the grey and restless sea. Bread is one of "
    "the oldest prepared foods. Evidence from thirty thousand years ago in Europe shows starch residue "
    "on rocks used for pounding plants, and by the time of the first cities bakers were already a "
    "respected trade. Leavened bread, made to rise with wild yeast, spread from Egypt to Greece and "
    "Rome, where public ovens baked loaves for whole neighbourhoods. The industrial age brought roller "
    "mills and sliced loaves, yet small bakeries still rise before dawn to shape dough by hand, and many "
    "families keep a sourdough starter alive for years, feeding it flour and water like a patient and "
    "demanding pet. Rivers shape the land they cross. A young mountain stream cuts a narrow valley with "
    "steep sides, while an old river winds slowly across a wide plain, dropping silt that builds rich "
    "farmland. Cities grew along rivers because they offered water, food, transport and power, and even "
    "now most of the world's great capitals sit on the banks of one."
)
GREEDY_ARGS = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
GREEDY = SamplingParams(**GREEDY_ARGS)


def gen(
    llm: LLM, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None
) -> list[RequestOutput]:
    return llm.generate(prompts, params, use_tqdm=False)


def one(llm: LLM, prompt: Any, params: SamplingParams) -> CompletionOutput:
    [out] = gen(llm, [prompt], params)
    assert out.finished and len(out.outputs) == 1
    return out.outputs[0]


# roomy and tight schedule asynchronously (CUDA's default; each step is launched before the last one's
# tokens are processed), and reference does not: the tests that compare them check the one against the other.
ROOMY = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "kv_cache_gib": 0.25}


@pytest.fixture(scope="module")
def roomy(default_model_dir: Path) -> LLM:
    return LLM(str(default_model_dir), async_scheduling=True, **ROOMY)


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> LLM:
    """A roomy engine without prefix caching: every prompt is computed from scratch."""
    return LLM(str(default_model_dir), enable_prefix_caching=False, **ROOMY)


@pytest.fixture(scope="module")
def tight(default_model_dir: Path) -> LLM:
    """A 64-token budget (chunked prefill) and 24 KV blocks of 16 tokens: barely one max_model_len."""
    llm = LLM(
        str(default_model_dir),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        block_size=16,
        num_gpu_blocks_override=24,
        max_num_batched_tokens=64,
        async_scheduling=True,
    )
    assert llm.engine.block_manager.num_blocks == 24
    return llm


@pytest.fixture(scope="module")
def text_ids(roomy: LLM) -> list[int]:
    ids = roomy.get_tokenizer().encode(TEXT)
    assert len(ids) > 300
    return ids


@pytest.fixture(scope="module")
def chat_prompt(roomy: LLM) -> list[int]:
    return roomy.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])


def stats_delta(llm: LLM, before: dict[str, Any]) -> dict[str, Any]:
    after = llm.engine.stats()
    return {k: after[k] - before[k] for k in ("prefix_cache_queries", "prefix_cache_hits", "preemptions")}


# -- batching -------------------------------------------------------------------------------------


def test_batch_with_chunked_prefill_and_preemption_matches_solo_runs(
    tight: LLM, reference: LLM, text_ids: list[int]
) -> None:
    ids = text_ids
    short = [ids[37 * i + 3 : 37 * i + 8] for i in range(4)]  # 5 tokens
    # A 64-token common prefix (four full blocks), then suffixes of 10 to 80 tokens.
    shared = [ids[:64] + ids[150 + 13 * i : 160 + 27 * i] for i in range(6)]
    long = [ids[20 * i + 1 : 20 * i + 151 - 5 * i] for i in range(6)]  # 125 to 150 tokens
    prompts = [short[0], shared[0], long[0], shared[1], short[1], long[1], shared[2], long[2]]
    prompts += [short[2], shared[3], long[3], shared[4], short[3], long[4], shared[5], long[5]]
    assert len(prompts) == 16
    assert {len(p) for p in short} == {5} and max(len(p) for p in long) == 150

    before = tight.engine.stats()
    batch = gen(tight, prompts, GREEDY)
    delta = stats_delta(tight, before)
    assert delta["preemptions"] > 0
    assert delta["prefix_cache_hits"] > 0
    assert any(out.num_cached_tokens >= 48 for out, p in zip(batch, prompts, strict=True) if p in shared)
    assert not tight.engine.has_unfinished()
    assert tight.engine.stats()["kv_cache_usage"] == 0.0

    for prompt, out in zip(prompts, batch, strict=True):
        assert out.prompt_token_ids == prompt
        [c] = out.outputs
        assert len(c.token_ids) == 24 and c.finish_reason == "length"
        alone = one(reference, prompt, GREEDY)
        assert c.token_ids == alone.token_ids
        assert c.text == alone.text


def test_prompt_logprobs_survive_preemption(tight: LLM, roomy: LLM, text_ids: list[int]) -> None:
    """A request that is preempted and recomputed must report each prompt position once."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    # Each grows to 150 tokens (10 blocks); three of them cannot fit in 24 blocks together.
    prompts = [text_ids[0:120], text_ids[100:220], text_ids[200:320]]
    before = tight.engine.stats()
    outs = gen(tight, prompts, [GREEDY, GREEDY, params])
    assert stats_delta(tight, before)["preemptions"] > 0
    got = outs[2]
    expected = gen(roomy, [prompts[2]], params)[0]
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.prompt_logprobs is not None and expected.prompt_logprobs is not None
    assert len(expected.prompt_logprobs) == len(prompts[2])
    assert len(got.prompt_logprobs) == len(prompts[2])
    assert got.prompt_logprobs[0] is None
    for g, e in zip(got.prompt_logprobs[1:], expected.prompt_logprobs[1:], strict=True):
        assert g is not None and e is not None and g.keys() == e.keys()
        for token, lp in g.items():
            assert lp.logprob == pytest.approx(e[token].logprob, abs=1e-4)


# -- prefix caching -------------------------------------------------------------------------------


def test_prefix_cache_hit_is_reported_and_exact(roomy: LLM, reference: LLM, text_ids: list[int]) -> None:
    prefix = text_ids[100:164]
    a = [*prefix, *text_ids[10:20]]
    b = [*prefix, *text_ids[260:272]]
    out_a = gen(roomy, [a], GREEDY)[0]
    assert out_a.num_cached_tokens == 0

    before = roomy.engine.stats()
    out_b = gen(roomy, [b], GREEDY)[0]
    delta = stats_delta(roomy, before)
    assert out_b.num_cached_tokens == 64
    assert delta["prefix_cache_hits"] == 64
    assert delta["prefix_cache_queries"] == len(b)

    uncached = gen(reference, [b], GREEDY)[0]
    assert uncached.num_cached_tokens == 0
    assert out_b.outputs[0].token_ids == uncached.outputs[0].token_ids
    assert out_b.outputs[0].text == uncached.outputs[0].text


# -- sampling and seeds ---------------------------------------------------------------------------


def test_seeded_request_is_independent_of_its_batch(roomy: LLM) -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = one(roomy, "Once upon a time", seeded)
    greedy = one(roomy, "Once upon a time", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert alone.token_ids != greedy.token_ids  # it really sampled

    others = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.05, max_tokens=16, ignore_eos=True),
    ]
    prompts = ["The weather today", "Once upon a time", "In a galaxy far away", "Once upon a time"]
    outs = gen(roomy, prompts, [others[0], seeded, others[1], others[2]])
    assert outs[1].outputs[0].token_ids == alone.token_ids
    assert outs[1].outputs[0].text == alone.text
    # A different seed gives a different sample.
    other_seed = SamplingParams(temperature=0.8, top_p=0.9, seed=4321, max_tokens=16, ignore_eos=True)
    assert one(roomy, "Once upon a time", other_seed).token_ids != alone.token_ids


def test_top_k_1_is_greedy(roomy: LLM) -> None:
    greedy = one(roomy, "The best way to learn", SamplingParams(temperature=0.0, max_tokens=16))
    top1 = one(roomy, "The best way to learn", SamplingParams(temperature=1.0, top_k=1, max_tokens=16))
    assert top1.token_ids == greedy.token_ids


def test_n_samples_with_a_seed_are_reproducible_and_distinct(roomy: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = gen(roomy, "My favourite food is", params)[0]
    second = gen(roomy, "My favourite food is", params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert [c.text for c in first.outputs] == [c.text for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in first.outputs)


# -- stopping -------------------------------------------------------------------------------------


def test_stop_strings(roomy: LLM) -> None:
    tok = roomy.get_tokenizer()
    base = one(roomy, "Once upon a time", GREEDY)
    assert "Haven" in base.text and "bustling" in base.text

    def first_index_containing(stop: str) -> int:
        return next(k for k in range(1, 25) if stop in tok.decode(base.token_ids[:k]))

    out = one(roomy, "Once upon a time", SamplingParams(temperature=0.0, max_tokens=24, stop=["Haven"]))
    cut = base.text.index("Haven")
    assert out.text == base.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == "Haven"
    assert out.token_ids == base.token_ids[: first_index_containing("Haven")]

    kept = SamplingParams(temperature=0.0, max_tokens=24, stop=["Haven"], include_stop_str_in_output=True)
    out = one(roomy, "Once upon a time", kept)
    assert out.text == base.text[: cut + len("Haven")]
    assert out.stop_reason == "Haven"

    # The earliest of several stops wins, even one that ends inside a token.
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=["bustling", "Nova Ha"])
    out = one(roomy, "Once upon a time", params)
    assert out.text == base.text[: base.text.index("Nova Ha")]
    assert out.stop_reason == "Nova Ha"
    assert out.token_ids == base.token_ids[: first_index_containing("Nova Ha")]


def test_stop_token_ids(roomy: LLM) -> None:
    tok = roomy.get_tokenizer()
    base = one(roomy, "Once upon a time", GREEDY)
    k = next(i for i in range(3, 24) if base.token_ids.index(base.token_ids[i]) == i)  # first occurrence
    stop_id = base.token_ids[k]
    out = one(
        roomy, "Once upon a time", SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id])
    )
    assert out.token_ids == base.token_ids[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == tok.decode(base.token_ids[:k])  # as vLLM: the stop token's text is left out
    kept = one(
        roomy,
        "Once upon a time",
        SamplingParams(
            temperature=0.0, max_tokens=24, stop_token_ids=[stop_id], include_stop_str_in_output=True
        ),
    )
    assert kept.text == tok.decode(base.token_ids[: k + 1])


def test_eos_min_tokens_and_ignore_eos(roomy: LLM, chat_prompt: list[int]) -> None:
    eos = roomy.get_tokenizer().convert_tokens_to_ids("<|im_end|>")
    base = one(roomy, chat_prompt, SamplingParams(temperature=0.0, max_tokens=40))
    assert "Paris" in base.text
    assert base.finish_reason == "stop" and base.stop_reason is None
    assert base.token_ids[-1] == eos and eos not in base.token_ids[:-1]
    k = len(base.token_ids) - 1  # EOS position

    out = one(roomy, chat_prompt, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=k + 4))
    assert len(out.token_ids) >= k + 4
    assert eos not in out.token_ids[: k + 4]
    assert out.token_ids[:k] == base.token_ids[:k]

    out = one(roomy, chat_prompt, SamplingParams(temperature=0.0, max_tokens=k + 6, ignore_eos=True))
    assert len(out.token_ids) == k + 6 and out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids[: k + 1] == base.token_ids

    out = one(roomy, chat_prompt, SamplingParams(temperature=0.0, max_tokens=3))
    assert out.token_ids == base.token_ids[:3]
    assert out.finish_reason == "length" and out.stop_reason is None


# -- allowed tokens, bad words, truncation --------------------------------------------------------


def test_allowed_token_ids_bound_the_draw_not_the_logprobs(roomy: LLM) -> None:
    tok = roomy.get_tokenizer()
    base = one(roomy, "Once upon a time", GREEDY)
    # Every greedy token allowed: the same tokens.
    allowed = SamplingParams(allowed_token_ids=sorted(set(base.token_ids)), **GREEDY_ARGS)
    assert one(roomy, "Once upon a time", allowed).token_ids == base.token_ids
    pets = [tok.encode(" cat")[0], tok.encode(" dog")[0]]
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature,
            seed=5,
            max_tokens=12,
            ignore_eos=True,
            allowed_token_ids=pets,
            logprobs=0,
        )
        out = one(roomy, "Once upon a time", params)
        assert set(out.token_ids) <= set(pets)
    # Logprobs are the model's own (vLLM's raw logprobs): the first pet is far from the model's top token.
    assert out.logprobs is not None and out.logprobs[0][out.token_ids[0]].rank > 1


def test_bad_words_are_never_generated(roomy: LLM) -> None:
    base = one(roomy, "Once upon a time", GREEDY)
    assert " bustling" in base.text and " Nova Haven" in base.text
    # " bustling" is one token mid-text (three alone): banned after a space too.
    out = one(roomy, "Once upon a time", SamplingParams(bad_words=["bustling"], **GREEDY_ARGS))
    assert "bustling" not in out.text
    cut = base.text.index(" bustling")
    assert out.text[:cut] == base.text[:cut]
    # Two tokens: " Haven" is banned only right after " Nova".
    out = one(roomy, "Once upon a time", SamplingParams(bad_words=["Nova Haven"], **GREEDY_ARGS))
    assert " Nova" in out.text and "Nova Haven" not in out.text
    assert out.text.startswith(base.text[: base.text.index(" Haven")])


def test_truncate_prompt_tokens_keeps_the_prompt_end(roomy: LLM, text_ids: list[int]) -> None:
    cut = one(roomy, text_ids[-40:], GREEDY)
    [out] = gen(roomy, [text_ids], SamplingParams(truncate_prompt_tokens=40, **GREEDY_ARGS))
    assert out.prompt_token_ids == text_ids[-40:] and out.outputs[0].token_ids == cut.token_ids
    # -1: as much of the prompt as leaves room for max_tokens.
    [out] = gen(roomy, [text_ids], SamplingParams(truncate_prompt_tokens=-1, **GREEDY_ARGS))
    assert out.prompt_token_ids == text_ids[-(MAX_MODEL_LEN - 24) :] and len(out.outputs[0].token_ids) == 24


def test_a_cache_salt_keeps_prefix_caches_apart(roomy: LLM, text_ids: list[int]) -> None:
    prompt = text_ids[30:100]
    salted = {"prompt_token_ids": prompt, "cache_salt": "tenant-a"}
    first, again = gen(roomy, [salted], GREEDY)[0], gen(roomy, [salted], GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64
    other = gen(roomy, [{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], GREEDY)[0]
    plain = gen(roomy, [prompt], GREEDY)[0]
    assert other.num_cached_tokens == plain.num_cached_tokens == 0
    texts = {o.outputs[0].text for o in (first, again, other, plain)}
    assert len(texts) == 1  # the salt changes what is shared, never what is generated
    [out] = gen(roomy, [{"prompt": "Water boils at", "cache_salt": "x"}], GREEDY)
    assert out.outputs[0].text == one(roomy, "Water boils at", GREEDY).text


def test_priority_orders_the_queue(default_model_dir: Path) -> None:
    """One sequence at a time: requests run in (priority, arrival) order, smaller priority first."""
    options = {"enforce_eager": True, "max_num_seqs": 1, "scheduling_policy": "priority"}
    llm = LLM(str(default_model_dir), **options, **ROOMY)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for rid, priority in [("later", 1), ("low", 9), ("urgent", -3), ("later-2", 1)]:
        llm.engine.add_request(rid, "Water boils at", params, priority=priority)
    finished = []
    while llm.engine.has_unfinished():
        finished += [out.request_id for out in llm.engine.step(final_only=True)]
    assert finished == ["urgent", "later", "later-2", "low"]
    outs = llm.generate(["Hi", "Hello"], params, use_tqdm=False, priority=[2, 1])
    assert [o.prompt for o in outs] == ["Hi", "Hello"]  # outputs keep the prompts' order


def test_too_few_kv_blocks_for_max_model_len(default_model_dir: Path) -> None:
    """vLLM's num_gpu_blocks_override wins over the memory settings, but must still hold one request."""
    with pytest.raises(
        ValueError, match="num_gpu_blocks_override=15 leaves a KV cache of 240 tokens, fewer than "
    ):
        LLM(str(default_model_dir), block_size=16, num_gpu_blocks_override=15, **ROOMY)


def test_chat_content_parts_reach_the_template_as_the_api_gives_them(roomy: LLM) -> None:
    """As the API (and vLLM's LLM.chat): text parts joined by newlines for SmolLM2's template, which
    prints a message's content; the list of parts where asked (openai), which this template cannot read."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    joined = [{"role": "user", "content": "a\nb"}]
    assert roomy.apply_chat_template(parts) == roomy.apply_chat_template(joined)
    with pytest.raises(ValueError, match="the chat template rejected these messages"):
        roomy.apply_chat_template(parts, chat_template_content_format="openai")  # (what LLM.chat did before)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="only text content parts are supported"):
        roomy.apply_chat_template(image)
    with pytest.raises(ValueError, match="must be auto, string or openai, not 'raw'"):
        roomy.apply_chat_template(joined, chat_template_content_format="raw")


def test_chat_shows_the_tools_to_the_template(roomy: LLM) -> None:
    """SmolLM2's template shows no tools, so this one, set for the test, names them."""
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "What time is it?"}]
    tokenizer = roomy.get_tokenizer()
    saved = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    )
    try:
        assert (
            tokenizer.decode(roomy.apply_chat_template(messages, tools=[tool])) == "get_time;What time is it?"
        )
        [out] = roomy.chat(
            messages, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, tools=[tool]
        )
        assert tokenizer.decode(out.prompt_token_ids) == "get_time;What time is it?"
    finally:
        tokenizer.chat_template = saved


def test_the_model_s_sampling_defaults(default_model_dir: Path, roomy: LLM) -> None:
    """As vLLM's LLM: without params, a request samples as the model's generation config recommends
    (here an override of it: greedy, 5 tokens)."""
    override = {"temperature": 0.0, "max_new_tokens": 5}
    llm = LLM(str(default_model_dir), enforce_eager=True, override_generation_config=override, **ROOMY)
    assert llm.engine.sampling_defaults == {"temperature": 0.0, "max_tokens": 5}
    [out] = gen(llm, ["The capital of France is"])
    assert (
        out.outputs[0].token_ids
        == one(roomy, "The capital of France is", SamplingParams(temperature=0, max_tokens=5)).token_ids
    )


def test_bad_allowed_ids_and_bad_words_are_rejected_up_front(clean_roomy: LLM) -> None:
    with pytest.raises(ValueError, match=r"^allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match=r"^bad_words must not contain empty words"):
        SamplingParams(bad_words=["ok", " "])
    with pytest.raises(ValueError, match=r"^allowed_token_ids token ids must be in \[0, 49152\)"):
        gen(clean_roomy, ["Hi"], SamplingParams(max_tokens=2, allowed_token_ids=[5, 49152]))
    with pytest.raises(ValueError, match=r"^bad_words: too many after tokenization"):
        gen(clean_roomy, ["Hi"], SamplingParams(max_tokens=2, bad_words=[f"word{i}" for i in range(100)]))
    assert not clean_roomy.engine.output.parents
    assert_still_works(clean_roomy)


def test_bad_request_options_are_rejected_up_front(clean_roomy: LLM) -> None:
    with pytest.raises(ValueError, match=r"^priority 2 needs the priority scheduling policy"):
        clean_roomy.generate(["Hi", "Hello"], GREEDY, use_tqdm=False, priority=[0, 2])
    with pytest.raises(ValueError, match=r"^got 1 priorities for 2 prompts"):
        clean_roomy.generate(["Hi", "Hello"], GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match=r"^cache_salt must be a non-empty string"):
        gen(clean_roomy, [{"prompt": "Hi", "cache_salt": ""}], GREEDY)
    with pytest.raises(ValueError, match=r"^prompt dicts take .* not \['salt'\]"):
        gen(clean_roomy, [{"prompt": "Hi", "salt": "x"}], GREEDY)
    with pytest.raises(
        ValueError, match=r"^a prompt dict needs exactly one of prompt, prompt_token_ids and prompt_embeds"
    ):
        gen(clean_roomy, [{"prompt": "Hi", "prompt_token_ids": [1]}], GREEDY)
    assert not clean_roomy.engine.output.parents
    assert_still_works(clean_roomy)


def test_generation_stops_at_max_model_len(roomy: LLM, text_ids: list[int]) -> None:
    prompt = text_ids[:250]
    unbounded = one(roomy, prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(unbounded.token_ids) == MAX_MODEL_LEN - 250
    assert unbounded.finish_reason == "length"
    capped = one(roomy, prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    assert capped.token_ids == unbounded.token_ids and capped.finish_reason == "length"
    last = one(roomy, text_ids[: MAX_MODEL_LEN - 1], SamplingParams(temperature=0.0, ignore_eos=True))
    assert len(last.token_ids) == 1 and last.finish_reason == "length"


# -- logprobs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def reference_logprobs(hf_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0]
    return logits.float().log_softmax(dim=-1)


def check_position(entry: dict, row: torch.Tensor, token: int, k: int, tok: Any) -> None:
    top = row.topk(k)
    assert set(entry) == {token, *top.indices.tolist()}
    chosen = entry[token]
    assert chosen.logprob == pytest.approx(row[token].item(), abs=1e-4)
    assert chosen.rank == int((row > row[token]).sum()) + 1
    assert chosen.decoded_token == tok.decode([token])
    for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), 1):
        assert entry[tid].rank == rank
        assert entry[tid].logprob == pytest.approx(value, abs=1e-4)
        assert entry[tid].decoded_token == tok.decode([tid])


def test_prompt_logprobs_taken_a_few_rows_at_a_time_match_transformers(
    default_model_dir: Path, hf_model: Any, text_ids: list[int]
) -> None:
    """The runner takes prompt logprobs max_num_seqs rows at a time (their vocabulary-wide logits would
    outgrow the GPU memory profile): 3 here, so each 64-token step spans 22 chunks."""
    llm = LLM(str(default_model_dir), enforce_eager=True, max_num_seqs=3, max_num_batched_tokens=64, **ROOMY)
    prompt = text_ids[:100]
    out = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    ref = reference_logprobs(hf_model, prompt)
    for j in range(1, len(prompt)):
        check_position(out.prompt_logprobs[j], ref[j - 1], prompt[j], 2, llm.get_tokenizer())


def test_logprobs_match_transformers(roomy: LLM, hf_model: Any) -> None:
    tok = roomy.get_tokenizer()
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. Then it")
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    out = gen(roomy, [prompt], params)[0]
    [c] = out.outputs
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 10
    ref = reference_logprobs(hf_model, prompt + c.token_ids)

    n = len(prompt)
    for i, (entry, token) in enumerate(zip(c.logprobs, c.token_ids, strict=True)):
        check_position(entry, ref[n - 1 + i], token, 3, tok)
    # A seeded temperature-1 sample is not always the top token: both cases are covered.
    assert any(len(e) == 4 for e in c.logprobs)
    assert c.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids, strict=True)), abs=1e-4
    )

    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == n
    assert out.prompt_logprobs[0] is None
    for j in range(1, n):
        check_position(out.prompt_logprobs[j], ref[j - 1], prompt[j], 2, tok)


def test_greedy_logprobs_rank_one(roomy: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    c = one(roomy, "Water boils at", params)
    assert c.logprobs is not None and len(c.logprobs) == 6
    for entry, token in zip(c.logprobs, c.token_ids, strict=True):
        assert list(entry) == [token]
        assert entry[token].rank == 1 and entry[token].logprob <= 0.0
    assert one(roomy, "Water boils at", SamplingParams(temperature=0.0, max_tokens=6)).logprobs is None


# -- bad input ------------------------------------------------------------------------------------


def assert_still_works(llm: LLM) -> None:
    assert not llm.engine.has_unfinished()
    out = one(llm, "Hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("too_long", "max_model_len"),
        ("exactly_max", "max_model_len"),
        ("", "empty"),
        ([], "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ([1, 2, 49152], r"token ids must be in \[0, 49152\)"),
        ([-1, 2], r"token ids must be in \[0, 49152\)"),
    ],
)
def test_bad_prompts_are_rejected(roomy: LLM, text_ids: list[int], prompt: Any, match: str) -> None:
    if prompt == "too_long":
        prompt = text_ids[:300]
    elif prompt == "exactly_max":
        prompt = text_ids[:MAX_MODEL_LEN]
    with pytest.raises(ValueError, match=match):
        gen(roomy, [prompt], GREEDY)
    # A bad prompt among good ones queues none of them.
    with pytest.raises(ValueError, match=match):
        gen(roomy, ["A good prompt", prompt], GREEDY)
    assert not roomy.engine.output.parents
    assert_still_works(roomy)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("n", 0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
    ],
)
def test_bad_sampling_values_name_the_field(roomy: LLM, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{field} .*{value!r}"):
        SamplingParams(**{field: value})
    assert_still_works(roomy)


@pytest.fixture
def clean_roomy(roomy: LLM) -> Iterator[LLM]:
    """roomy, with anything a failing test left queued aborted afterwards so later tests still run."""
    yield roomy
    for request_id in list(roomy.engine.output.parents):
        roomy.engine.abort(request_id)


def test_out_of_vocab_logit_bias_is_rejected_up_front(clean_roomy: LLM) -> None:
    params = SamplingParams(max_tokens=2, logit_bias={49152: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        gen(clean_roomy, ["Hi there, how are you?"], params)
    assert_still_works(clean_roomy)


def test_max_logprobs_bounds_what_a_request_may_ask(roomy: LLM) -> None:
    """model.max_logprobs (vLLM's --max-logprobs): 20 by default; -1 makes it the vocabulary."""
    admission = roomy.engine.admission
    assert admission.max_logprobs == 20
    with pytest.raises(ValueError, match=r"^logprobs must be at most 20, got 21"):
        admission.check_params(SamplingParams(logprobs=21))
    whole = dataclasses.replace(admission, max_logprobs=admission.vocab_size)  # what -1 resolves to
    whole.check_params(SamplingParams(logprobs=1000, prompt_logprobs=49152))
    assert EngineConfig.from_options(max_logprobs=-1).model.max_logprobs == -1


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_the_vocabulary_is_rejected_up_front(clean_roomy: LLM, field: str) -> None:
    params = SamplingParams(max_tokens=2, **{field: 49153})
    with pytest.raises(ValueError, match=field):
        gen(clean_roomy, ["Hi there, how are you?"], params)
    assert_still_works(clean_roomy)


def test_repetition_penalty_greedy_matches_transformers(roomy: LLM, hf_model: Any) -> None:
    """The penalty reads the prompt and the output so far (the runner passes them only when a row uses
    one): greedy tokens equal transformers' generate with the same penalty."""
    tok = roomy.get_tokenizer()
    prompt = tok.encode("one two one two one two one two one two")
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    penalised = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    with torch.inference_mode():
        want = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
            repetition_penalty=1.8, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
    got = [o.outputs[0].token_ids for o in gen(roomy, [prompt, prompt], [penalised, plain])]
    assert got[0] == want
    assert got[1] != got[0]  # the penalty changed the text


# -- beam search ----------------------------------------------------------------------------------


def test_beam_search_matches_transformers(roomy: LLM, hf_model: Any) -> None:
    """Where no beam meets EOS, vLLM's algorithm (each beam's 2 x width best, the width best overall) is
    transformers': the same beams, in the same order."""
    tok = roomy.get_tokenizer()
    prompt = tok.encode("The history of the lighthouse begins")
    with torch.inference_mode():
        want = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=8, num_beams=3, num_return_sequences=3, do_sample=False,
            length_penalty=1.0, early_stopping=False, pad_token_id=0,
        )[:, len(prompt):].tolist()  # fmt: skip
    [out] = roomy.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=8))
    assert [s.tokens[len(prompt) :] for s in out.sequences] == want
    assert all(s.finish_reason == "length" for s in out.sequences)
    scores = [s.cum_logprob for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    assert out.sequences[0].text == tok.decode(out.sequences[0].tokens, skip_special_tokens=True)
    # Width 1 is greedy decoding.
    [single] = roomy.beam_search(
        ["The history of the lighthouse begins"], BeamSearchParams(beam_width=1, max_tokens=8)
    )
    greedy = one(roomy, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert single.sequences[0].tokens[len(prompt) :] == greedy.token_ids
    # Each beam's logprobs are its tokens' own, and sum to its score.
    best = out.sequences[0]
    own = [entry[t].logprob for t, entry in zip(best.tokens[len(prompt) :], best.logprobs, strict=True)]
    assert sum(own) == pytest.approx(best.cum_logprob, abs=1e-4)


def test_beam_search_ends_beams_at_eos(roomy: LLM, chat_prompt: list[int]) -> None:
    """A chat reply ends in EOS: finished beams are kept apart and ranked with the running ones."""
    eos = roomy.engine.eos_token_ids
    params = BeamSearchParams(beam_width=2, max_tokens=40, length_penalty=1.0)
    [out] = roomy.beam_search([chat_prompt], params)
    best = out.sequences[0]
    assert best.finish_reason == "stop" and best.stop_reason in eos
    assert best.tokens[-1] not in eos  # left out unless include_stop_str_in_output
    assert "Paris" in best.text
    kept = msgspec.structs.replace(params, include_stop_str_in_output=True)
    [out] = roomy.beam_search([chat_prompt], kept)
    assert out.sequences[0].tokens[-1] in eos
    assert out.sequences[0].cum_logprob == pytest.approx(best.cum_logprob, abs=1e-4)
    with pytest.raises(ValueError, match=r"^beam_width must be in \[1, 10\]"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        roomy.beam_search([chat_prompt], BeamSearchParams(beam_width=2, max_tokens=MAX_MODEL_LEN))
