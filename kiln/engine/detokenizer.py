from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

# Enough prompt tokens to give the first output token its context (a leading space, a merged byte).
_CONTEXT = 6


class IncrementalDetokenizer:
    """Turns output tokens into text as they arrive, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("kiln needs a fast tokenizer (a model folder with tokenizer.json)")
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=prompt_ids[-_CONTEXT:], skip_special_tokens=skip_special_tokens)

    def step(self, token_ids: list[int]) -> str:
        out = []
        for token_id in token_ids:
            chunk = self._stream.step(self._backend, token_id)
            if chunk:
                out.append(chunk)
        return "".join(out)


def find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last num_new_chars characters: (start index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
