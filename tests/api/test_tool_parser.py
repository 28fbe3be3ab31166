"""tool_choice "auto"'s parsers on their own: the same content and calls however the text is cut into
deltas, tags split across deltas held back, unclosed and broken calls."""

from __future__ import annotations

import json
import re

import pytest

from kiln.api.protocol import FunctionDefinition, Tool
from kiln.api.tool_parser import HermesTools, MistralTools, parser_for

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
TEXT = f"Let me check. {CALL}\n<tool_call>\n" + '{"name": "get_time", "parameters": {}}\n</tool_call>\nDone.'


def streamed(
    text: str, size: int, parser: str = "hermes", tools: list[Tool] | None = None
) -> tuple[str, list[tuple[str, dict]]]:
    parsed, content, calls = parser_for(parser, tools or []), "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        got, deltas = parsed.feed(piece, final=i == len(pieces) - 1)
        content += got
        calls += [(d.function.name, json.loads(d.function.arguments)) for d in deltas]
    return content, calls


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11, 1000])
def test_any_cut_into_deltas_gives_the_whole_reply(size: int) -> None:
    content, calls = HermesTools().whole(TEXT)
    assert content == "Let me check. "  # as vLLM: text after the first call is not content
    want = [("get_weather", {"city": "Zürich"}), ("get_time", {})]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
    assert streamed(TEXT, size) == ("Let me check. ", want)


def test_a_tail_that_may_open_a_tag_waits_for_the_next_delta() -> None:
    parsed = HermesTools()
    assert parsed.feed("Hello <tool", final=False) == ("Hello ", [])
    assert parsed.feed("kit", final=False) == ("<toolkit", [])
    assert parsed.feed(" <", final=True) == (" <", [])


def test_unclosed_and_broken_calls() -> None:
    content, calls = HermesTools().whole('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert content is None and [c.function.arguments for c in calls] == ['{"x": 1}']  # cut by max_tokens
    broken = "Sure.<tool_call>{name: f}</tool_call>"
    assert HermesTools().whole(broken) == (broken, [])  # left as the model wrote it
    assert HermesTools().whole("No calls.") == ("No calls.", [])


LLAMA = '{"name": "get_weather", "parameters": {"city": "Zürich"}}; {"name": "get_time", "arguments": {}}'


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_llama3_json_calls_content_and_broken_replies(size: int) -> None:
    want = [("get_weather", {"city": "Zürich"}), ("get_time", {})]
    for text in (LLAMA, "<|python_tag|>" + LLAMA, "  " + LLAMA + "\n"):
        content, calls = parser_for("llama3_json", []).whole(text)
        assert (
            content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
        )
        assert streamed(text, size, "llama3_json") == ("", want)
    for text in (
        "The weather is fine.",
        'Here: {"name": "f", "parameters": {}}',
        '{"answer": 42}',
        "{broken",
    ):
        # A JSON reply that is no call is content.
        assert parser_for("llama3_json", []).whole(text) == (text, [])
        assert streamed(text, size, "llama3_json") == (text, [])
    assert parser_for("llama3_json", []).feed("<|python", final=False) == ("", [])  # may still open the tag


# Mistral's two formats: a JSON list after the tag (tokenizers before v11), name[ARGS]{...} after each tag.
MISTRAL = {
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}}, {"name": "get_time", '
    '"arguments": {}}]': "",
    'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]get_time[ARGS]{}': "Checking.",
}


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_mistral_calls_in_both_formats(size: int) -> None:
    want = [("get_weather", {"city": "Zürich"}), ("get_time", {})]
    for text, before in MISTRAL.items():
        content, calls = MistralTools().whole(text)
        assert content == (before or None)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
        assert all(re.fullmatch("[A-Za-z0-9]{9}", c.id) for c in calls)  # the ids its templates take
        assert streamed(text, size, "mistral") == (before, want)
    for text in (
        "The weather is fine, [TOOL_CALLS is not the tag.",
        'Sure.[TOOL_CALLS] [{"name": "f", "arguments": {broken}]',
        "[TOOL_CALLS]get_weather[ARGS]{broken",
        '[TOOL_CALLS] [{"answer": 42}]',
    ):
        assert MistralTools().whole(text) == (text, [])  # as the model wrote it, tag included
        assert streamed(text, size, "mistral") == (text, [])
    assert MistralTools().feed("Hi [TOOL_", final=False) == ("Hi ", [])  # may still open the tag


CODER_TOOLS = [
    Tool(
        "function",
        FunctionDefinition(
            "edit",
            parameters={
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "line": {"type": "integer"},
                    "scale": {"type": "number"},
                    "dry_run": {"type": "boolean"},
                    "tags": {"type": "array"},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                },
            },
        ),
    )
]
CODER = (
    "I will edit it.\n<tool_call>\n<function=edit>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
    "<parameter=line>\n42\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n"
    '<parameter=dry_run>\nTrue\n</parameter>\n<parameter=tags>\n["x", 1]\n</parameter>\n'
    "<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n007\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=edit>\n<parameter=path>\nline one\nline two\n</parameter>\n</function>\n"
    "</tool_call>"
)


@pytest.mark.parametrize("size", [1, 6, 1000])
def test_qwen3_coder_calls_typed_by_their_schemas(size: int) -> None:
    """Each value as its parameter's type (a string where the schema says nothing, as `extra`); a value
    keeps its inner newlines."""
    first = {"path": "src/a.py", "line": 42, "scale": 1.5, "dry_run": True, "tags": ["x", 1], "note": None}
    want = [("edit", first | {"extra": "007"}), ("edit", {"path": "line one\nline two"})]
    content, calls = parser_for("qwen3_coder", CODER_TOOLS).whole(CODER)
    assert content == "I will edit it.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
    assert streamed(CODER, size, "qwen3_coder", CODER_TOOLS) == ("I will edit it.\n", want)
    # Not a call: left in the content as written, as hermes leaves bad JSON.
    text = "<tool_call>\nno function here\n</tool_call>"
    assert parser_for("qwen3_coder", CODER_TOOLS).whole(text) == (text, [])
    # A value that is not its type stays text; an unknown tool's values are all text.
    odd = "<tool_call><function=edit><parameter=line>forty</parameter></function></tool_call>"
    assert json.loads(parser_for("qwen3_coder", CODER_TOOLS).whole(odd)[1][0].function.arguments) == {
        "line": "forty"
    }
    other = "<tool_call><function=ls><parameter=n>3</parameter></function></tool_call>"
    assert json.loads(parser_for("qwen3_coder", []).whole(other)[1][0].function.arguments) == {"n": "3"}


PYTHONIC = '[get_weather(city="Zürich", days=[1, 2], metric=True), get_time()]'


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_pythonic_calls_and_what_is_content(size: int) -> None:
    want = [("get_weather", {"city": "Zürich", "days": [1, 2], "metric": True}), ("get_time", {})]
    for text in (PYTHONIC, f"<|python_start|>{PYTHONIC}<|python_end|>", f"  {PYTHONIC}\n"):
        content, calls = parser_for("pythonic", []).whole(text)
        assert content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
        assert streamed(text, size, "pythonic") == ("", want)
    for text in (
        "Sure, here it is.",
        "[1, 2, 3]",  # a list, not calls
        '[get_weather("Paris")]',  # a positional argument: no name to give it
        "[os.system(cmd='ls')]",  # not a plain name
        "[f(x=open('a'))]",  # not a literal: parsed, never run
        "[f(**kw)]",
        "[get_weather(city=",  # cut by max_tokens
    ):
        assert parser_for("pythonic", []).whole(text) == (text, [])
        assert streamed(text, size, "pythonic") == (text, [])
