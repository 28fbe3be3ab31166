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
    text: str = ""
    pos: int = 0  # the text before pos is handled
    state: str = "start"  # "start" (nothing read yet), "thinking" or "answering"

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        text, reasoning, content = self.text, "", ""
        if self.state == "start":
            head = text[self.pos :].lstrip()
            if head.startswith(OPEN):
                self.pos, self.state = len(text) - len(head) + len(OPEN), "thinking"
            elif not final and OPEN.startswith(head):
                return "", ""  # may still open with the tag
            else:
                self.state = "thinking" if self.parser == "deepseek_r1" else "answering"
        if self.state == "thinking":
            stop = text.find(CLOSE, self.pos)
            end = stop if stop >= 0 else len(text) - (0 if final else held(text, CLOSE))
            reasoning, self.pos = text[self.pos : max(end, self.pos)], max(end, self.pos)
            if stop < 0:
                return reasoning, ""
            self.pos, self.state = stop + len(CLOSE), "answering"
        content, self.pos = text[self.pos :], len(text)
        return reasoning, content

    def whole(self, text: str) -> tuple[str | None, str | None]:
        """A finished choice's reasoning and content (None where empty)."""
        reasoning, content = self.feed(text, final=True)
        return reasoning or None, content or None
