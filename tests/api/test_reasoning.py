"""The reasoning parsers on their own: the same split however the text is cut into deltas, and where
deepseek_r1 and qwen3 differ (a reply without <think>)."""

from __future__ import annotations

import pytest

from kiln.api.reasoning import ThinkSplit

THOUGHT = "<think>\nLet me think about it.\n</think>\n\nThe answer is 4."
CASES = {
    # text: (deepseek_r1's (reasoning, content), qwen3's)
    THOUGHT: (("\nLet me think about it.\n", "\n\nThe answer is 4."),) * 2,
    "Plain answer.": (("Plain answer.", None), (None, "Plain answer.")),
    "\nThinking</think>Answer": (("\nThinking", "Answer"), (None, "\nThinking</think>Answer")),
    "<think>cut short by max_tokens </thi": (("cut short by max_tokens </thi", None),) * 2,
}


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_whole_and_streamed_agree(parser: str, size: int) -> None:
    for text, expected in CASES.items():
        want = expected[parser == "qwen3"]
        assert ThinkSplit(parser).whole(text) == want
        split, reasoning, content = ThinkSplit(parser), "", ""
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            r, c = split.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content or None) == want


def test_a_tag_split_across_deltas_waits() -> None:
    split = ThinkSplit("qwen3")
    assert split.feed("<thi", final=False) == ("", "")
    assert split.feed("nk>Hmm</th", final=False) == ("Hmm", "")
    assert split.feed("ink>Yes", final=False) == ("", "Yes")
