"""Incremental detokenization against the default model's tokenizer, and stop-string search."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from kiln.engine.detokenizer import IncrementalDetokenizer, find_stop

MULTIBYTE = "héllo 世界 🙂 and ñandú, Ελληνικά, 😀👍🏽 ok"
# Code points from several scripts, including 4-byte UTF-8 (emoji, CJK extension B).
ALPHABET = "aZ09 ,.\n\té߀世界日本語한국어ελληνικάкириллица🙂😀👍🏽🚀𝔘𠀋"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(default_model_dir)


def stream(tokenizer: Any, prompt: list[int], ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    return [detok.step([t]) for t in ids]


def output_text(tokenizer: Any, prompt: list[int], ids: list[int], skip: bool = True) -> str:
    """What the output tokens add to the decoded text of prompt + output."""
    full = tokenizer.decode(prompt + ids, skip_special_tokens=skip)
    head = tokenizer.decode(prompt, skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head) :]


def test_multibyte_text_streams_without_replacement_characters(tokenizer: Any) -> None:
    ids = tokenizer.encode(MULTIBYTE)
    # The text really does split characters across tokens, so holding partial bytes back matters.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    chunks = stream(tokenizer, [], ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tokenizer.decode(ids) == MULTIBYTE
    # Text is held back only while the decoded tokens end in an incomplete character.
    for i in range(1, len(ids) + 1):
        so_far, decoded = "".join(chunks[:i]), tokenizer.decode(ids[:i])
        assert decoded.startswith(so_far)
        assert so_far == decoded or decoded.endswith("\ufffd")


@pytest.mark.parametrize("prompt", ["", "Say:", "Hello there, ", "日本", "x 🙂"])
def test_output_after_a_prompt_matches_full_decode(tokenizer: Any, prompt: str) -> None:
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(" " + MULTIBYTE + "\n  end")
    chunks = stream(tokenizer, prompt_ids, ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == output_text(tokenizer, prompt_ids, ids)


def test_batched_steps_equal_single_steps(tokenizer: Any) -> None:
    ids = tokenizer.encode(MULTIBYTE)
    detok = IncrementalDetokenizer(tokenizer, [], True)
    text = detok.step(ids[:5]) + detok.step([]) + detok.step(ids[5:17]) + detok.step(ids[17:])
    assert text == MULTIBYTE


def test_random_valid_text_round_trips(tokenizer: Any) -> None:
    rng = random.Random(1234)
    for _ in range(40):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60)))
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        prompt_ids = tokenizer.encode(rng.choice(["", "a", "Q: ", "世界"]))
        chunks = stream(tokenizer, prompt_ids, ids)
        assert all("\ufffd" not in c for c in chunks), text
        assert "".join(chunks) == output_text(tokenizer, prompt_ids, ids), text


def test_random_token_ids_match_full_decode(tokenizer: Any) -> None:
    rng = random.Random(99)
    vocab = len(tokenizer)
    end = tokenizer.encode(" end")
    assert len(end) == 1
    held_back = 0
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        prompt_ids = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 8))]
        for skip in (True, False):
            full = output_text(tokenizer, prompt_ids, ids, skip)
            text = "".join(stream(tokenizer, prompt_ids, ids, skip))
            # Bytes that may still become a character are held back; everything else is out.
            if text != full:
                held_back += 1
                assert full.startswith(text) and full.endswith("\ufffd"), (ids, text, full)
            # A completing token flushes them: the streamed text is then the full decode exactly.
            text = "".join(stream(tokenizer, prompt_ids, [*ids, *end], skip))
            assert text == output_text(tokenizer, prompt_ids, [*ids, *end], skip)
    assert held_back > 0  # the sample did exercise sequences ending in a partial character


def test_special_tokens_are_skipped_or_kept(tokenizer: Any) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer.encode("Hi there"), im_end, *tokenizer.encode(" more")]
    assert "".join(stream(tokenizer, [], ids, True)) == "Hi there more"
    assert "".join(stream(tokenizer, [], ids, False)) == "Hi there<|im_end|> more"


def test_needs_a_fast_tokenizer() -> None:
    class Slow:
        is_fast = False

    with pytest.raises(ValueError, match="fast tokenizer"):
        IncrementalDetokenizer(Slow(), [1], True)


# -- find_stop ------------------------------------------------------------------------------------


def test_find_stop_within_the_new_chunk() -> None:
    assert find_stop("hello world", 6, ["world"]) == (6, "world")
    assert find_stop("hello world", 5, ["world"]) == (6, "world")
    assert find_stop("hello world!", 1, ["!"]) == (11, "!")


def test_find_stop_spanning_two_chunks() -> None:
    text = "hello wor"
    assert find_stop(text, 3, ["world"]) is None  # not complete yet
    text += "ld, bye"
    assert find_stop(text, 7, ["world"]) == (6, "world")
    # Only the last character of the stop is new.
    assert find_stop("abcSTO" + "P", 1, ["STOP"]) == (3, "STOP")
    # A stop spanning three chunks, completed by the last one.
    assert find_stop("xx" + "<e" + "n" + "d>", 1, ["<end>"]) == (2, "<end>")


def test_find_stop_ignores_stops_wholly_in_old_text() -> None:
    # Already checked when it arrived; a later chunk must not re-detect it.
    assert find_stop("a STOP b", 2, ["STOP"]) is None
    assert find_stop("a STOP b", 0, ["STOP"]) is None
    assert find_stop("STOP", 0, ["STOP"]) is None
    assert find_stop("", 0, ["STOP"]) is None


def test_find_stop_takes_the_earliest_of_several() -> None:
    text = "one two three"
    assert find_stop(text, len(text), ["three", "two", "one"]) == (0, "one")
    assert find_stop(text, 9, ["three", "two"]) == (4, "two")
    # The stop that starts earlier wins even when it is listed later or ends later.
    assert find_stop("xxabcdef", 6, ["ef", "abcd"]) == (2, "abcd")
    assert find_stop("xxabcdef", 6, ["abcdef", "cd"]) == (2, "abcdef")
    # The first occurrence of a repeated stop.
    assert find_stop("a.b.c.", 6, ["."]) == (1, ".")
    # One that started in old text and ends in the new chunk beats one wholly in the new chunk.
    assert find_stop("ab" + "cXY", 3, ["XY", "bc"]) == (1, "bc")
    assert find_stop("no stops here", 13, ["zz", "qq"]) is None


def test_no_spaces_between_special_tokens() -> None:
    """vLLM's spaces_between_special_tokens=False: a special token right after another loses the space a
    decoder that joins tokens by spaces puts before it (here the tokenizers default, with no decoder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", additional_special_tokens=["<a>", "<b>"]
    )
    ids = fast.encode("hello <a><b> world <b>")
    assert ids == [1, 3, 4, 2, 4]
    spaced = IncrementalDetokenizer(fast, [1], skip_special_tokens=False)
    assert [spaced.step([t]) for t in ids] == [" hello", " <a>", " <b>", " world", " <b>"]
    tight = IncrementalDetokenizer(fast, [1], False, spaces_between_special_tokens=False)
    assert [tight.step([t]) for t in ids] == [" hello", " <a>", "<b>", " world", " <b>"]
    # Skipped special tokens have no text to space.
    skipped = IncrementalDetokenizer(fast, [1], True, spaces_between_special_tokens=False)
    assert "".join(skipped.step([t]) for t in ids) == " hello world"
