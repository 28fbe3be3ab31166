"""vLLM's bad_words: each word as token sequences, and the tokens a sequence's output may not take next."""

from __future__ import annotations

from typing import Any

MAX_BAD_WORDS = 128  # token sequences a request may ban (vLLM's VLLM_MAX_NUM_BAD_WORDS default)

BadWords = tuple[tuple[int, ...], ...]


def tokenize_bad_words(tokenizer: Any, words: list[str], vocab_size: int) -> BadWords:
    """Each word alone and after a space (mid-text, where most tokenizers fold the space into the word),
    the second where it tokenizes otherwise. vLLM keeps the second only where it has as many tokens as the
    first, so a word the tokenizer splits alone but not after a space (SmolLM2's "bustling": 3 tokens, 1)
    stays allowed mid-text there; kiln bans both."""
    seqs: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        seqs += [seq for seq in {alone: None, spaced: None} if seq]  # distinct, in order; none empty
        if len(seqs) > MAX_BAD_WORDS:
            raise ValueError(
                f"bad_words: too many after tokenization ({len(seqs)} token sequences); "
                f"the most is {MAX_BAD_WORDS}"
            )
    bad = [t for seq in seqs for t in seq if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"bad_words tokenize to ids outside the vocabulary [0, {vocab_size}): {bad[:4]}")
    return tuple(seqs)


def banned_next(words: BadWords, token_ids: list[int], num_prompt_tokens: int) -> list[int]:
    """The last token of each sequence whose other tokens end the output so far (prompt + output in
    token_ids; a one-token word always). Reads only each sequence's length of the output's end."""
    banned = []
    produced = len(token_ids) - num_prompt_tokens
    for seq in words:
        n = len(seq) - 1
        if n == 0 or (n <= produced and tuple(token_ids[-n:]) == seq[:-1]):
            banned.append(seq[-1])
    return banned
