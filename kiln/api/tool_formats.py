"""How each model family writes its tool calls, read into ToolCalls once a call's text is whole (the
streaming parsers in kiln.api.tool_parser find where that text is). Each reader returns None for text that
is not such calls, which the parsers then leave as content."""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from typing import Any

from kiln.api.protocol import FunctionCall, ToolCall
from kiln.api.tool_calls import call_id, mistral_call_id

PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


def json_call(value: Any, make_id: Callable[[], str] = call_id) -> ToolCall | None:
    """A call from its JSON, as text or parsed: {"name", "arguments" (or "parameters")}."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(make_id(), FunctionCall(value["name"], arguments))


def llama3_calls(text: str) -> list[ToolCall] | None:
    """Llama 3.1-3.3: {"name", "parameters"} objects separated by ";", after an optional <|python_tag|>.
    Unlike vLLM's whole-reply parser, a JSON object after some text is content, as its streaming parser
    has it, so both ways of reading a reply agree."""
    text, decoder, found = text.lstrip(), json.JSONDecoder(), []
    pos = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos == len(text):
            return found or None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = json_call(value)
        if call is None:
            return None
        found.append(call)


def pythonic_calls(text: str) -> list[ToolCall] | None:
    """Llama 3.2 and 4's pythonic calls: a Python list of calls with keyword arguments, each a literal,
    `[get_weather(city="Paris"), get_time()]` (Llama 4 may wrap it in <|python_start|> and <|python_end|>).
    Parsed, never run."""
    text = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    found = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            text = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        if len(arguments) < len(node.keywords):  # a **mapping: no literal names
            return None
        found.append(ToolCall(call_id(), FunctionCall(node.func.id, text)))
    return found


def mistral_calls(text: str) -> list[ToolCall] | None:
    """The calls in the text from the first [TOOL_CALLS] on, in either of Mistral's formats."""
    segments = [s.strip() for s in text.split(TOOL_CALLS)[1:]]
    try:
        if segments and all(ARGS in s for s in segments):  # v11: name[ARGS]{...} after each tag
            parts = [s.partition(ARGS) for s in segments]
            items = [{"name": name.strip(), "arguments": json.loads(args)} for name, _, args in parts]
        else:
            value = json.loads(" ".join(segments))
            items = value if isinstance(value, list) else [value]
    except ValueError:
        return None
    calls = []
    for item in items:
        call = json_call(item, mistral_call_id)
        if call is None or not call.function.name:
            return None
        calls.append(call)
    return calls or None


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def xml_call(body: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    """Qwen3-Coder's call: <function=NAME> with <parameter=KEY>VALUE</parameter> elements (a parameter
    left open ends at the next one or the function's end, as vLLM reads it)."""
    function = _FUNCTION.search(body)
    if function is None:
        return None
    name, properties = function[1].strip(), schemas.get(function[1].strip(), {})
    arguments = {}
    for p in _PARAMETER.finditer(function[2]):
        value = p[2].removeprefix("\n").removesuffix("\n")
        arguments[p[1].strip()] = typed(value, properties.get(p[1].strip()))
    return ToolCall(call_id(), FunctionCall(name, json.dumps(arguments, ensure_ascii=False)))


def typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type, as vLLM's qwen3_coder parser reads it: a string where the
    schema says so or says nothing, else the number, boolean, null or JSON the text holds (the text itself
    where it holds none)."""
    if not isinstance(schema, dict):
        return value
    kinds = schema.get("type") or [o.get("type") for o in schema.get("anyOf", ()) if isinstance(o, dict)]
    kinds = [kinds] if isinstance(kinds, str) else [k for k in kinds if isinstance(k, str)]
    if "null" in kinds and value.lower() in ("null", "none"):
        return None
    kind = next((k for k in kinds if k != "null"), "string")
    if kind == "string":
        return value
    if value.lower() in ("null", "none"):
        return None
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = float(value)
            if not math.isfinite(number):
                return value  # JSON has no infinities
            return int(number) if number.is_integer() else number
        if kind == "boolean":
            return value.strip().lower() == "true"
        return json.loads(value)
    except ValueError:
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return value
