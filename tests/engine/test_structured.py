"""Structured output in the engine: offline through SamplingParams(structured_outputs=...), the grammar
cache, the bitmask in the sampler, and forced tool calls parsed whole and streamed."""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kiln import LLM, SamplingParams
from kiln.api.tool_calls import ToolCallStream
from kiln.engine.grammar import Grammars
from kiln.ops.sampler import Sampler
from kiln.ops.sampling_metadata import SamplingMetadata
from kiln.sampling_params import StructuredOutputsParams

S = StructuredOutputsParams


@pytest.fixture(scope="module")
def grammars(default_model_dir: Path) -> Grammars:
    load = lambda: AutoTokenizer.from_pretrained(default_model_dir)
    g = Grammars(load, len(load()), {2})
    yield g
    g.close()


def matches(grammars: Grammars, params: StructuredOutputsParams, text: str) -> bool:
    seq = grammars.start(grammars.check(params))
    seq.compiled.result(timeout=60)
    assert seq.active and seq.matcher is not None
    return seq.matcher.accept_string(text) and seq.matcher.is_completed()


def test_choices_are_taken_literally(grammars: Grammars) -> None:
    choices = ['say "hi"', "back\\slash", "two\nlines", "é 😀"]
    for c in choices:
        assert matches(grammars, S(choice=choices), c)
    assert not matches(grammars, S(choice=choices), "say hi")


def test_schema_property_order_is_kept(grammars: Grammars) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert matches(grammars, S(json=schema), '{"b": 1, "a": 2}')
    assert not matches(grammars, S(json=json.dumps(schema)), '{"a": 2, "b": 1}')


def test_cache_hits_and_misses(grammars: Grammars) -> None:
    before = (grammars.stats.hits, grammars.stats.misses)
    constraint = grammars.check(S(regex="cache-[0-9]"))
    first, second = grammars.start(constraint), grammars.start(constraint)
    assert first.compiled is second.compiled
    assert (grammars.stats.hits - before[0], grammars.stats.misses - before[1]) == (1, 1)


def test_schema_that_fails_xgrammars_cache_compiles_without_it(
    grammars: Grammars, caplog: pytest.LogCaptureFixture
) -> None:
    """xgrammar 0.2.8's cache fails a check on this valid schema (mlc-ai/xgrammar#647); it is compiled
    without the cache and constrains as it should. 0.2.9 compiles it with the cache: no warning there."""
    fields = {f"f{i}": {"type": "string", "pattern": f"[a-z]{{3,{120 + i}}}[0-9]{{2,9}}"} for i in range(40)}
    schema = {"type": "object", "properties": fields, "required": list(fields)}
    assert matches(grammars, S(json=schema), json.dumps({name: "abc12" for name in fields}))
    assert not matches(grammars, S(json=schema), json.dumps({name: "ab12" for name in fields}))
    mended = tuple(int(part) for part in version("xgrammar").split(".")[:3]) >= (0, 2, 9)
    assert mended or "compiling without xgrammar's cache" in caplog.text


@pytest.mark.parametrize(
    ("params", "says"),
    [
        (S(json={"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}), "multipleOf"),
        (S(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (S(json={"type": "string", "format": "credit-card"}), "format"),
        (S(json={"type": "string", "pattern": "a+", "maxLength": 3}), "length bound"),
        (S(json='"a string"'), "schema object"),
        (S(json={"$ref": "#/missing"}), "invalid JSON schema"),
        (S(regex="a\x00"), "NUL"),
        (S(choice=["a", ""]), "non-empty"),
        (S(grammar="root ::= [z-a]"), "invalid grammar"),
    ],
)
def test_bad_constraints(grammars: Grammars, params: StructuredOutputsParams, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        grammars.check(params)


def test_a_model_without_an_end_token_refuses_constraints(default_model_dir: Path) -> None:
    """xgrammar ends a grammar on a stop token: without one, a clear error when the request arrives (not
    an abort once it is queued)."""
    load = lambda: AutoTokenizer.from_pretrained(default_model_dir)
    g = Grammars(load, len(load()), set())
    with pytest.raises(ValueError, match="needs a model with an end-of-sequence token"):
        g.check(S(regex="a+"))
    g.close()


def test_params_take_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", grammar='root ::= "a"')


def test_sampler_masks_only_the_grammar_rows() -> None:
    """Row 0 may take tokens 3 and 40 only; row 1 is free and keeps its argmax."""
    vocab = 64
    logits = torch.zeros(2, vocab)
    logits[:, 7] = 5.0
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3
    bitmask[0, 1] = 1 << (40 - 32)
    p = SamplingParams(temperature=0.0)
    meta = SamplingMetadata.build(
        [p, p], [None, None], [[], []], vocab, torch.device("cpu"), None, (bitmask, [0])
    )
    out = Sampler()(logits, meta)
    assert out.token_ids.tolist() == [3, 7]
    assert torch.isinf(logits[0]).sum() == vocab - 2 and not torch.isinf(logits[1]).any()


def test_required_calls_stream_as_they_complete() -> None:
    text = '[{"name": "f", "parameters": {"x": "}"}}, {"name": "g", "parameters": {}}]'
    stream, deltas = ToolCallStream(None), []
    for i in range(0, len(text), 3):
        deltas += stream.feed(text[i : i + 3])
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "f", {"x": "}"}),
        (1, "g", {}),
    ]
    whole = ToolCallStream(None).whole(text)
    assert [(c.function.name, c.function.arguments) for c in whole] == [("f", '{"x": "}"}'), ("g", "{}")]
    assert [c.function.name for c in ToolCallStream(None).whole(text[:50])] == ["f"]  # cut by max_tokens


def test_named_call_streams_its_arguments() -> None:
    stream = ToolCallStream("f")
    first, second = stream.feed('{"x"'), stream.feed(": 1}")
    assert first[0].id and first[0].function.name == "f" and first[0].function.arguments == '{"x"'
    assert second[0].id is None and second[0].function.arguments == ": 1}"
    # The answer's first delta may be empty (the step that ended the thinking): the head goes once.
    stream = ToolCallStream("f")
    deltas = [d for text in ("", '{"x"', ": 1}") for d in stream.feed(text)]
    assert [d.function.name for d in deltas] == ["f", None, None]
    assert "".join(d.function.arguments for d in deltas) == '{"x": 1}'


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return LLM("default", max_model_len=512)


@pytest.mark.slow
def test_offline_generate(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ask = llm.apply_chat_template([{"role": "user", "content": "When was the Eiffel tower built?"}])
    date = r"\d{4}-\d{2}-\d{2}"
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate([ask], free, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(
        temperature=1.0, seed=3, n=3, max_tokens=24, structured_outputs=S(regex=date)
    )
    choice = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=S(choice=["1887", "1889"]))
    outs = llm.generate([ask, ask, tok.encode("The year:")], [free, constrained, choice], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone  # a free row beside grammar rows is unchanged
    assert len(outs[1].outputs) == 3 and all(re.fullmatch(date, c.text) for c in outs[1].outputs)
    assert outs[2].outputs[0].text in ("1887", "1889")

    bad = SamplingParams(structured_outputs=S(regex="(a"))
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate([ask, ask], [free, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished()  # nothing of the failed call stays queued


@pytest.mark.slow
def test_a_grammar_at_its_end_ends_the_request_before_min_tokens(llm: LLM) -> None:
    """min_tokens bans EOS, and a complete choice allows nothing but EOS: the grammar wins, as in vLLM
    (#54218), and the request stops with its choice (it was aborted for a token outside the grammar). Where
    the grammar allows more than its end, min_tokens still holds."""
    prompt = llm.get_tokenizer().encode("Is the sky blue? Answer yes or no:")
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature,
            seed=1,
            max_tokens=12,
            min_tokens=8,
            structured_outputs=S(choice=["yes", "no"]),
        )
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (out.text in ("yes", "no"), out.finish_reason, out.stop_reason) == (True, "stop", None)
    more = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, structured_outputs=S(regex="(ab)+"))
    out = llm.generate([prompt], more, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("(ab)+", out.text) and len(out.token_ids) >= 6


def test_the_servers_compact_json(default_model_dir: Path) -> None:
    """structured_outputs_config.disable_any_whitespace (vLLM's): every JSON constraint compact, as a
    request's own disable_any_whitespace makes it."""
    load = lambda: AutoTokenizer.from_pretrained(default_model_dir)
    compact = Grammars(load, len(load()), {2}, compact=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    try:
        for g, params, spaced in [
            (compact, S(json=schema), False),
            (compact, S(json_object=True), False),
            (Grammars(load, len(load()), {2}), S(json=schema), True),
        ]:
            assert matches(g, params, '{"a": 1}') is spaced
            assert matches(g, params, '{"a":1}')
    finally:
        compact.close()
