from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

# Enough prompt tokens to give the first output token its context (a leading space, a merged byte).
_CONTEXT = 6


class IncrementalDetokenizer:
    """Turns output tokens into text as they arrive, never splitting a UTF-8 character.
    spaces_between_special_tokens=False (with special tokens kept), as vLLM: a special token right after
    another is its own text, without the space a decoder that joins tokens by spaces puts before it."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("kiln needs a fast tokenizer (a model folder with tokenizer.json)")
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=prompt_ids[-_CONTEXT:], skip_special_tokens=skip_special_tokens)
        self._added: dict[int, str] | None = None
        if not (skip_special_tokens or spaces_between_special_tokens):
            self._added = {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()}
        self._last_added = False

    def step(self, token_ids: list[int]) -> str:
        out = []
        for token_id in token_ids:
            chunk = self._stream.step(self._backend, token_id)
            if self._added is not None:
                content = self._added.get(token_id)
                if content is not None and self._last_added:
                    chunk = content
                self._last_added = content is not None
            if chunk:
                out.append(chunk)
        return "".join(out)


class NoText:
    """Where there is no tokenizer (skip_tokenizer_init): outputs are token ids, their text empty."""

    def step(self, token_ids: list[int]) -> str:
        return ""


def detokenizer(
    tokenizer: Any,
    prompt_ids: list[int],
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool = True,
) -> IncrementalDetokenizer | NoText:
    if tokenizer is None:
        return NoText()
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, spaces_between_special_tokens)


def find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last num_new_chars characters: (start index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


class SequenceText:
    """A sequence's output text, built token by token. While it runs, its last `hold` characters (one
    fewer than its longest stop string) are held back: a stop string may still begin there, and the text
    outputs show must never include what a stop later trims. The rest is settled, in pieces, so that
    neither a step nor a delta ever copies the whole text."""

    def __init__(self, detokenizer: IncrementalDetokenizer | NoText, stop: list[str]) -> None:
        self.detokenizer = detokenizer
        self.hold = max(0, max(map(len, stop), default=0) - 1)
        self.settled: list[str] = []
        self.held = ""
        self.num_sent = 0  # settled pieces already in a delta

    def add(self, token_id: int) -> str:
        new = self.detokenizer.step([token_id])
        self.held += new
        return new

    def find_stop(self, num_new_chars: int, stops: list[str], include: bool) -> str | None:
        """The earliest stop string ending in the newest characters; trims the text at it."""
        hit = find_stop(self.held, num_new_chars, stops)
        if hit is None:
            return None
        start, stop = hit
        self.held = self.held[: start + len(stop)] if include else self.held[:start]
        return stop

    def settle(self, final: bool) -> None:
        keep = 0 if final else self.hold
        if len(self.held) > keep:
            cut = len(self.held) - keep
            self.settled.append(self.held[:cut])
            self.held = self.held[cut:]

    def delta(self) -> str:
        new = "".join(self.settled[self.num_sent :])
        self.num_sent = len(self.settled)
        return new

    def whole(self) -> str:
        return "".join(self.settled) + self.held
