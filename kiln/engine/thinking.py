"""A reasoning model's reply as the engine sees it (model.reasoning_parser): where its thinking ends, so
that structured outputs constrain only the answer after it (vLLM's default), and thinking_token_budget,
which forces the closing tag once the thinking has taken that many tokens. The rules are the parsers'
(kiln.api.reasoning), in tokens: deepseek_r1 thinks from the reply's start until </think>; qwen3 thinks
only where the reply opens with <think>."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<think>", "</think>"


class Phase(enum.Enum):
    OPENING = "opening"  # qwen3, before the reply has shown whether it opens with <think>
    THINKING = "thinking"
    ANSWERING = "answering"


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """The parser's tags as the tokenizer writes them (one token each in Qwen3's and DeepSeek-R1's
    vocabularies, several in others')."""

    open: tuple[int, ...]
    close: tuple[int, ...]
    opens_in_reply: bool  # qwen3: the reply thinks only where it opens with `open`

    @classmethod
    def of(cls, parser: str, tokenizer: Any) -> ThinkTags:
        def ids(tag: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(tag, add_special_tokens=False))

        return cls(ids(OPEN), ids(CLOSE), opens_in_reply=parser == "qwen3")


@dataclass(slots=True, eq=False)
class Thinking:
    """One sequence's place in its reply's reasoning, advanced by each token it samples. The per-token work
    is constant: a count and how much of a tag the reply's tail holds."""

    tags: ThinkTags
    budget: int | None  # reasoning tokens allowed before the closing tag is forced; None: no limit
    # Under a grammar, a qwen3 reply's first token is the grammar's or the opening tag (one token only:
    # a tag of several would start like text the grammar allows).
    grammar: bool = False
    phase: Phase = Phase.THINKING
    thought: int = 0  # tokens of reasoning so far (after an opening tag)
    matched: int = 0  # tokens of the tag being read (OPENING: `open`; THINKING: `close`) at the tail

    def __post_init__(self) -> None:
        if self.tags.opens_in_reply:
            multi = len(self.tags.open) > 1
            self.phase = Phase.ANSWERING if self.grammar and multi else Phase.OPENING

    @property
    def answering(self) -> bool:
        return self.phase is Phase.ANSWERING

    @property
    def opener(self) -> int | None:
        """The token that may open the thinking beside the grammar's own, for this step."""
        return self.tags.open[0] if self.phase is Phase.OPENING and self.grammar else None

    def forced(self) -> int | None:
        """The one token this step may sample: the closing tag's next, once the budget is spent."""
        if self.phase is Phase.THINKING and self.budget is not None and self.thought >= self.budget:
            return self.tags.close[self.matched]
        return None

    def advance(self, token: int) -> bool:
        """Takes the sampled token; whether it belongs to the answer (the grammar's to accept)."""
        if self.phase is Phase.ANSWERING:
            return True
        tags = self.tags
        if self.phase is Phase.OPENING:
            if token != tags.open[self.matched]:
                self.phase = Phase.ANSWERING
                return True
            self.matched += 1
            if self.matched == len(tags.open):
                self.phase, self.matched = Phase.THINKING, 0
            return False
        self.thought += 1
        if token == tags.close[self.matched]:
            self.matched += 1
        else:
            self.matched = 1 if token == tags.close[0] else 0
        if self.matched == len(tags.close):
            self.phase, self.matched = Phase.ANSWERING, 0
        return False
