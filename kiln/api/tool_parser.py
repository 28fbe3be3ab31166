"""tool_choice "auto": a model's free text into content and tool calls, by the format its chat template
teaches (`server.tool_call_parser`, vLLM's --tool-call-parser). hermes (Qwen2.5 and 3, Hermes, and most
models trained on them): each call a JSON object {"name", "arguments"} between <tool_call> tags."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kiln.api.protocol import DeltaFunction, DeltaToolCall, FunctionCall, ToolCall
from kiln.api.tool_calls import call_id

# parser name -> the tags around each call
PARSERS: dict[str, tuple[str, str]] = {"hermes": ("<tool_call>", "</tool_call>")}


@dataclass(slots=True)
class AutoToolStream:
    """One choice's text, as it comes. The text before the first call is content, streamed as it comes
    less a tail that may be the start of a tag; each call is sent whole once its closing tag comes (or the
    text ends). As vLLM's hermes parser, text after the first call's tag is not content. A call whose JSON
    does not parse stays in the content as the model wrote it; vLLM then makes the whole reply content."""

    parser: str
    text: str = ""
    pos: int = 0  # the text before pos is handled
    inside: bool = False  # within a call's tags
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """The new content and calls; final: the text is whole (unclosed calls and held tails count)."""
        opening, closing = PARSERS[self.parser]
        self.text += delta
        text, content, out = self.text, [], []
        while True:
            if not self.inside:
                start = text.find(opening, self.pos)
                end = start if start >= 0 else len(text) - (0 if final else _held(text, opening))
                if not self.calls:
                    content.append(text[self.pos : end])
                self.pos = max(self.pos, end)
                if start < 0:
                    break
                self.pos, self.inside = start + len(opening), True
            stop = text.find(closing, self.pos)
            if stop < 0 and not final:
                break
            body = text[self.pos : stop if stop >= 0 else len(text)]
            call = _call(body)
            if call is None:
                content.append(opening + body + (closing if stop >= 0 else ""))
            else:
                whole = DeltaFunction(call.function.name, call.function.arguments)
                out.append(DeltaToolCall(len(self.calls), whole, call.id, "function"))
                self.calls.append(call)
            self.pos, self.inside = (stop + len(closing) if stop >= 0 else len(text)), False
            if stop < 0:
                break
        return "".join(content), out

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished choice's content (None when empty) and calls."""
        content, _ = self.feed(text, final=True)
        return content or None, self.calls


def _held(text: str, tag: str) -> int:
    """How many of text's last characters could begin tag: they wait for the next delta."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _call(body: str) -> ToolCall | None:
    try:
        value: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call_id(), FunctionCall(value["name"], arguments))
