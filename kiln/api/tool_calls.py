"""Forced tool calls: `tool_choice` as the JSON the model must write, and that JSON as OpenAI tool calls,
whole or as stream deltas. A named function is constrained to its parameters' schema, so the text is
the call's arguments; "required" is constrained, as in vLLM, to a list of {"name", "parameters"}
objects, one per call."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.api.errors import APIError
from kiln.api.protocol import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall
from kiln.api.responses import DeltaFunction, DeltaToolCall

_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


def forced_call_schema(
    body: ChatCompletionRequest, auto: bool = False
) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON schema a forced call is held to and the named function (None for "required"); (None,
    None) when no call is forced. "auto" (the default with tools) needs a parser of the model's text
    into calls (auto: the server has one, kiln.api.tool_parser); without one it is a 400, as in vLLM."""
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None, None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools must have distinct function names", "tools")
    if choice == "none":
        return None, None
    if choice is None or choice == "auto":
        if auto:
            return None, None
        raise APIError(
            400,
            'tool_choice "auto" (the default when tools are given) needs a parser of this model\'s tool-call '
            "format: serve with --enable-auto-tool-choice --tool-call-parser hermes, or set tool_choice to "
            '"required", "none" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise APIError(
                400, f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice"
            )
        return tool.function.parameters or _NO_ARGUMENTS, tool.function.name
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or _NO_ARGUMENTS,
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema, None


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's chat templates take only ids of 9 letters and digits in the turns that follow."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(slots=True)
class ToolCallStream:
    """One choice's text as tool calls. A named call streams its arguments as the model writes them; a
    "required" list sends each call whole once its object is complete."""

    name: str | None  # the named function; None: "required"
    make_id: Callable[[], str] = call_id
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _scan: int = 0  # where the next call of a "required" list may start

    def feed(self, delta: str) -> list[DeltaToolCall]:
        self.text += delta
        if self.name is not None:
            if not self.calls:  # the call's head, once: its first delta may be empty (thinking just ended)
                self.calls.append(ToolCall(self.make_id(), FunctionCall(self.name, "")))
                head = DeltaFunction(self.name, delta)
                return [DeltaToolCall(0, head, self.calls[0].id, "function")]
            return [DeltaToolCall(0, DeltaFunction(arguments=delta))] if delta else []
        if "}" not in delta:  # a call's object can only end at a closing brace
            return []
        out = []
        for call in self._complete_calls():
            whole = DeltaFunction(call.function.name, call.function.arguments)
            out.append(DeltaToolCall(len(self.calls), whole, call.id, "function"))
            self.calls.append(call)
        return out

    def whole(self, text: str) -> list[ToolCall]:
        """Every call in a finished choice's text (a list cut short by max_tokens keeps its whole calls;
        a named call keeps its arguments as written)."""
        if self.name is not None:
            return [ToolCall(self.make_id(), FunctionCall(self.name, text))]
        self.text = text
        self.calls = self._complete_calls()
        return self.calls

    def _complete_calls(self) -> list[ToolCall]:
        decoder, text, out = json.JSONDecoder(), self.text, []
        while True:
            i = self._scan
            while i < len(text) and text[i] in " \t\r\n[,":
                i += 1
            try:
                value, end = decoder.raw_decode(text, i)
            except ValueError:
                return out
            self._scan = end
            if isinstance(value, dict) and isinstance(value.get("name"), str):
                arguments = json.dumps(value.get("parameters", {}), ensure_ascii=False)
                out.append(ToolCall(self.make_id(), FunctionCall(value["name"], arguments)))
