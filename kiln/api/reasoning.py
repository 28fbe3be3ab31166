"""A reasoning model's thinking apart from its answer (`server.reasoning_parser`, vLLM's
--reasoning-parser): the text between <think> and </think> is the reply's `reasoning`, the rest its content.
- deepseek_r1 (DeepSeek-R1, QwQ; templates that open <think> in the prompt): the reply is reasoning from
  its start, <think> or not, until </think>; a reply cut before it is all reasoning.
- qwen3 (Qwen3 with enable_thinking): the reply is reasoning only where it opens with <think>; a reply
  without it is all content (enable_thinking false)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.api.tool_parser import held

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclass(slots=True)
class ThinkSplit:
    """One choice's text, as it comes, into (reasoning, content) deltas; the same split whole or streamed.
    A tail that may be the start of a tag waits for the next delta."""

    parser: str
    text: str = ""  # what is not yet sent: a tail that may be a tag's start (a delta's work, not a reply's)
    state: str = "start"  # "start" (nothing read yet), "thinking" or "answering"

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        text, reasoning, self.text = self.text + delta, "", ""
        if self.state == "start":
            head = text.lstrip()
            if head.startswith(OPEN):
                text, self.state = head[len(OPEN) :], "thinking"
            elif not final and OPEN.startswith(head):
                self.text = text  # may still open with the tag
                return "", ""
            else:
                self.state = "thinking" if self.parser == "deepseek_r1" else "answering"
        if self.state == "thinking":
            stop = text.find(CLOSE)
            if stop < 0:
                end = len(text) - (0 if final else held(text, CLOSE))
                reasoning, self.text = text[:end], text[end:]
                return reasoning, ""
            reasoning, text, self.state = text[:stop], text[stop + len(CLOSE) :], "answering"
        return reasoning, text

    def whole(self, text: str) -> tuple[str | None, str | None]:
        """A finished choice's reasoning and content (None where empty)."""
        reasoning, content = self.feed(text, final=True)
        return reasoning or None, content or None
