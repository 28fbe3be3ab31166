"""tool_choice "auto": a model's free text into content and tool calls, by the format its chat template
teaches (`server.tool_call_parser`, vLLM's --tool-call-parser):
- hermes (Qwen2.5 and 3, Hermes, and most models trained on them): each call a JSON object
  {"name", "arguments"} between <tool_call> tags;
- llama3_json (Llama 3.1 to 3.3 with JSON tool calling): a reply that is calls starts with a JSON object
  {"name", "parameters"} (or <|python_tag|>), several separated by ";";
- mistral (Mistral and Mixtral instruct models): calls follow the [TOOL_CALLS] token, as a JSON list of
  {"name", "arguments"} (tokenizers before v11) or as name[ARGS]{...} after each [TOOL_CALLS] (v11 on);
- qwen3_coder (Qwen3-Coder): hermes' tags around <function=NAME> with a <parameter=KEY> element per
  argument, each value typed by the tool's JSON schema;
- pythonic (Llama 3.2 and 4): a reply that is calls is a Python list of them, [f(a=1), g()].
Each parser reads a choice's text as it comes (`feed`) or whole (`whole`), the same either way."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.api.protocol import Tool, ToolCall
from kiln.api.responses import DeltaFunction, DeltaToolCall
from kiln.api.tool_formats import (
    PYTHON_START,
    PYTHON_TAG,
    TOOL_CALLS,
    json_call,
    llama3_calls,
    mistral_calls,
    pythonic_calls,
    xml_call,
)


@dataclass(slots=True)
class HermesTools:
    """One choice's text, as it comes. The text before the first call is content, streamed as it comes
    less a tail that may be the start of a tag; each call is sent whole once its closing tag comes (or the
    text ends). As vLLM's hermes parser, text after the first call's tag is not content. A call whose JSON
    does not parse stays in the content as the model wrote it; vLLM then makes the whole reply content."""

    read: Callable[[str], ToolCall | None] | None = None  # a call's text into a call; None: its JSON
    text: str = ""  # what is not yet handled: an open call's text, or a tail that may start a tag
    inside: bool = False  # within a call's tags
    calls: list[ToolCall] = field(default_factory=list)
    pos: int = 0  # the text before pos is handled, within one feed

    def feed(self, delta: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """The new content and calls; final: the text is whole (unclosed calls and held tails count)."""
        opening, closing = "<tool_call>", "</tool_call>"
        # Only the unhandled tail is kept between deltas, so a delta's work never grows with the reply.
        scanned = max(len(self.text) - len(closing), 0) if self.inside else 0
        self.text += delta
        text, content, out = self.text, [], []
        while True:
            if not self.inside:
                start = text.find(opening, self.pos)
                end = start if start >= 0 else len(text) - (0 if final else held(text, opening))
                if not self.calls:
                    content.append(text[self.pos : end])
                self.pos = max(self.pos, end)
                if start < 0:
                    break
                self.pos, self.inside = start + len(opening), True
            stop = text.find(closing, max(self.pos, scanned))
            scanned = 0
            if stop < 0 and not final:
                break
            body = text[self.pos : stop if stop >= 0 else len(text)]
            call = (self.read or json_call)(body)
            if call is None:
                content.append(opening + body + (closing if stop >= 0 else ""))
            else:
                out.append(_sent(call, self.calls))
            self.pos, self.inside = (stop + len(closing) if stop >= 0 else len(text)), False
            if stop < 0:
                break
        self.text, self.pos = text[self.pos :], 0
        return "".join(content), out

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished choice's content (None when empty) and calls."""
        content, _ = self.feed(text, final=True)
        return content or None, self.calls


@dataclass(slots=True)
class ReplyOfCalls:
    """A reply that is all calls or all content, decided by how it begins: content where it does not begin
    as calls do, streamed as it comes; calls where it does, sent whole when the text ends, if all of it
    parses (else the whole reply is content, as vLLM's parsers make it). llama3_json and pythonic."""

    opens: tuple[str, ...]  # how a reply of calls begins (after any whitespace)
    parse: Callable[[str], list[ToolCall] | None]  # the whole reply into its calls, or None
    pieces: list[str] = field(default_factory=list)  # the text not yet sent, joined only at the end
    mode: str = ""  # "" undecided, "content" or "calls"
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        self.pieces.append(delta)
        if not self.mode:
            head = "".join(self.pieces).lstrip()  # short: undecided only until the reply's first characters
            if head.startswith(self.opens):
                self.mode = "calls"
            elif final or (head and not any(o.startswith(head) for o in self.opens)):
                self.mode = "content"
        if self.mode == "content":
            content, self.pieces = "".join(self.pieces), []
            return content, []
        if not final:
            return "", []
        text, self.pieces = "".join(self.pieces), []
        found = self.parse(text)
        if found is None:
            self.mode = "content"
            return text, []
        return "", [_sent(call, self.calls) for call in found]

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, _ = self.feed(text, final=True)
        return content or None, self.calls


@dataclass(slots=True)
class MistralTools:
    """One choice's text, as it comes: content until [TOOL_CALLS] (streamed, less a tail that may start
    the tag), the calls after it, sent whole when the text ends. Calls that do not parse stay in the
    content as the model wrote them, tag included. The tag is a special token: the request's text keeps
    special tokens while this parser reads it (as vLLM's mistral parser asks)."""

    text: str = ""  # a tail that may start the tag, or everything from the tag on
    inside: bool = False  # the tag has come
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        content = ""
        if self.inside:
            self.text += delta  # grows: the calls are parsed once whole
        else:
            text = self.text + delta
            start = text.find(TOOL_CALLS)
            if start < 0:
                end = len(text) - (0 if final else held(text, TOOL_CALLS))
                self.text = text[end:]
                return text[:end], []
            content, self.text, self.inside = text[:start], text[start:], True
        if not final:
            return content, []
        found = mistral_calls(self.text)
        if found is None:
            return content + self.text, []
        return content, [_sent(call, self.calls) for call in found]

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, _ = self.feed(text, final=True)
        return content or None, self.calls


def held(text: str, tag: str) -> int:
    """How many of text's last characters could begin tag: they wait for the next delta."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _sent(call: ToolCall, calls: list[ToolCall]) -> DeltaToolCall:
    """The call as one whole delta, taking the next index."""
    calls.append(call)
    whole = DeltaFunction(call.function.name, call.function.arguments)
    return DeltaToolCall(len(calls) - 1, whole, call.id, "function")


Parser = HermesTools | ReplyOfCalls | MistralTools


def parser_for(name: str, tools: list[Tool]) -> Parser:
    """The `tool_call_parser` named, for a request with these tools (qwen3_coder types the values by
    their schemas)."""
    if name == "qwen3_coder":
        schemas = {t.function.name: (t.function.parameters or {}).get("properties", {}) for t in tools}
        return HermesTools(functools.partial(xml_call, schemas=schemas))
    if name == "llama3_json":
        return ReplyOfCalls((PYTHON_TAG, "{"), llama3_calls)
    if name == "pythonic":
        return ReplyOfCalls((PYTHON_START, "["), pythonic_calls)
    if name == "mistral":
        return MistralTools()
    return HermesTools()
