"""A reasoning model's thinking in the engine (kiln.engine.thinking): structured outputs hold only the
answer after </think>, and thinking_token_budget forces </think> once the thinking has taken that many
tokens. Tiny random models: one with the default vocabulary, where the tags take three tokens each
(deepseek_r1), and one with <think> and </think> added as single tokens, as Qwen3's are (qwen3)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kiln.engine.thinking import Phase, Thinking, ThinkTags
from kiln.llm import LLM
from kiln.sampling_params import SamplingParams, StructuredOutputsParams
from tests.models.tiny import build_default_vocab

# Async scheduling: a thinking request lands its tokens before the next step samples (Request.reads_output).
OPTIONS = {
    "dtype": "float32",
    "max_model_len": 256,
    "kv_cache_gib": 0.02,
    "enforce_eager": True,
    "async_scheduling": True,
}
PROMPT = "Is the sky blue?"
YES = StructuredOutputsParams(choice=["yes"])


def greedy(max_tokens: int, **extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)  # type: ignore[arg-type]


# -- the state machine alone -----------------------------------------------------------------------------

TAGS = ThinkTags(open=(1, 2), close=(3, 4), opens_in_reply=False)
QWEN = ThinkTags(open=(5,), close=(6,), opens_in_reply=True)


def test_a_spent_budget_forces_the_closing_tag_then_lets_the_answer_go() -> None:
    t = Thinking(TAGS, budget=2)
    assert [t.forced(), t.advance(10), t.forced(), t.advance(11)] == [None, False, None, False]
    assert t.forced() == 3 and not t.advance(3)
    assert t.forced() == 4 and not t.advance(4)
    assert t.answering and t.forced() is None and t.advance(12)


def test_a_closing_tag_the_model_began_is_finished_not_restarted() -> None:
    t = Thinking(TAGS, budget=1)
    t.advance(3)  # the model's own first token of </think>, which spends the budget
    assert t.forced() == 4
    assert Thinking(TAGS, budget=0).forced() == 3  # 0: closed at once


def test_without_a_budget_the_model_closes_its_own_thinking() -> None:
    t = Thinking(TAGS, budget=None)
    for token in (10, 3, 10, 3, 4):  # a 3 not followed by 4 is thinking still
        assert t.forced() is None and not t.advance(token)
    assert t.answering and t.advance(10)


def test_qwen3_under_a_grammar_offers_the_opening_tag_beside_the_grammar() -> None:
    t = Thinking(QWEN, budget=None, grammar=True)
    assert t.phase is Phase.OPENING and t.opener == 5
    assert t.advance(7) and t.answering  # not opened: the token is the answer's, the grammar's to accept
    t = Thinking(QWEN, budget=None, grammar=True)
    assert not t.advance(5) and t.phase is Phase.THINKING and t.opener is None
    # A tag of several tokens would start like text the grammar allows: the grammar holds the whole reply.
    several = dataclasses.replace(QWEN, open=(5, 8))
    assert Thinking(several, budget=None, grammar=True).answering
    t = Thinking(several, budget=1)  # without a grammar, the reply's head is read as it comes
    assert not t.advance(5) and t.phase is Phase.OPENING and not t.advance(8) and t.phase is Phase.THINKING
    assert t.forced() is None and not t.advance(9) and t.forced() == 6


# -- in the engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> LLM:
    model = build_default_vocab(tmp_path_factory.mktemp("tiny-deepseek"), default_model_dir)
    return LLM(str(model), reasoning_parser="deepseek_r1", **OPTIONS)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> LLM:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model = build_default_vocab(path, default_model_dir, added=("<think>", "</think>"))
    return LLM(str(model), reasoning_parser="qwen3", **OPTIONS)


def tokens(llm: LLM, params: SamplingParams) -> list[int]:
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def test_the_budget_forces_the_closing_tag_after_that_many_tokens(deepseek: LLM) -> None:
    close = list(deepseek.engine.admission.think_tags.close)  # type: ignore[union-attr]
    assert len(close) == 3  # "</", "think", ">" in SmolLM2's vocabulary
    free = tokens(deepseek, greedy(12))
    assert free[4:7] != close  # the random model never closes on its own
    out = deepseek.generate(PROMPT, greedy(12, thinking_token_budget=4, logprobs=0), use_tqdm=False)[0]
    got = out.outputs[0]
    assert got.token_ids[:4] == free[:4] and got.token_ids[4:7] == close and len(got.token_ids) == 12
    # The forced tokens' logprobs are the model's own, as vLLM's: far from certain.
    assert all(got.logprobs[i][t].logprob < -1.0 for i, t in zip(range(4, 7), close, strict=True))
    assert tokens(deepseek, greedy(12, thinking_token_budget=-1)) == free  # -1: no limit


def test_a_constraint_holds_only_the_answer_after_the_thinking(deepseek: LLM) -> None:
    tok = deepseek.get_tokenizer()
    free = tokens(deepseek, greedy(8))
    # The thinking never ends here, so the constraint never starts: the reply is the model's own.
    held = deepseek.generate(PROMPT, greedy(8, structured_outputs=YES), use_tqdm=False)[0].outputs[0]
    assert held.token_ids == free and held.finish_reason == "length"
    got = deepseek.generate(
        PROMPT, greedy(40, structured_outputs=YES, thinking_token_budget=3), use_tqdm=False
    )[0].outputs[0]
    assert got.token_ids[:3] == free[:3]
    assert got.text == tok.decode(free[:3]) + "</think>yes" and got.finish_reason == "stop"


def test_qwen3_thinks_only_where_the_reply_opens_with_the_tag(qwen3: LLM) -> None:
    tok = qwen3.get_tokenizer()
    think, close = (tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    assert qwen3.engine.admission.think_tags == ThinkTags((think,), (close,), True)
    # Drawn to <think>, the reply opens with it, though the constraint alone would not allow it; thinks (the
    # bias keeps it on <think>) for its budget; then the constraint holds the answer.
    pulled = greedy(40, structured_outputs=YES, thinking_token_budget=2, logit_bias={think: 100.0})
    got = qwen3.generate(PROMPT, pulled, use_tqdm=False)[0].outputs[0]
    assert got.token_ids[:4] == [think, think, think, close]
    assert tok.decode(got.token_ids[4:], skip_special_tokens=True) == "yes" and got.finish_reason == "stop"
    # Kept from it, the reply is the answer from its first token.
    pushed = greedy(40, structured_outputs=YES, thinking_token_budget=2, logit_bias={think: -100.0})
    got = qwen3.generate(PROMPT, pushed, use_tqdm=False)[0].outputs[0]
    assert got.text == "yes" and think not in got.token_ids


def test_what_admission_refuses(deepseek: LLM) -> None:
    admission = deepseek.engine.admission
    budget = SamplingParams(thinking_token_budget=5)
    with pytest.raises(ValueError, match=r"^thinking_token_budget needs a reasoning parser"):
        dataclasses.replace(admission, think_tags=None).check_params(budget)
    held = dataclasses.replace(admission, constrain_thinking=True)
    with pytest.raises(
        ValueError, match=r"^thinking_token_budget cannot end the thinking while a constraint"
    ):
        held.check_params(SamplingParams(thinking_token_budget=5, structured_outputs=YES))
    held.check_params(budget)  # a budget alone is fine
    with pytest.raises(ValueError, match=r"^thinking_token_budget must be a non-negative integer or -1"):
        SamplingParams(thinking_token_budget=-2)
