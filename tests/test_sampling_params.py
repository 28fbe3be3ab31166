"""SamplingParams' own helpers: prompt truncation and repetition detection."""

from __future__ import annotations

import pytest

from kiln.sampling_params import RepetitionDetectionParams, truncate_prompt


def test_truncation_keeps_either_end() -> None:
    ids = list(range(10))
    assert truncate_prompt(ids, 3, None, 100) == [7, 8, 9]
    assert truncate_prompt(ids, 3, None, 100, "right") == [0, 1, 2]
    assert truncate_prompt(ids, -1, 95, 100, "right") == [0, 1, 2, 3, 4]  # room for 95 of 100
    assert truncate_prompt(ids, None, None, 100, "right") == ids


def test_repetition_is_a_pattern_repeated_at_the_end() -> None:
    detect = RepetitionDetectionParams(max_pattern_size=3, min_count=3)
    prompt = [99, 98]
    assert detect.repeats([*prompt, 5, 1, 2, 1, 2, 1, 2], 7)
    assert detect.repeats([*prompt, 7, 7, 7], 3)
    assert not detect.repeats([*prompt, 1, 2, 1, 2, 1, 3], 6)
    assert not detect.repeats([*prompt, 1, 2, 1, 2], 4)  # twice, not three times
    # Only output tokens count: the prompt's end does not complete a repetition.
    assert not detect.repeats([7, 7, 7], 2)
    # Longer than max_pattern_size: not looked for.
    assert not detect.repeats([1, 2, 3, 4] * 3, 12)
    # min_pattern_size skips the shorter patterns.
    assert not RepetitionDetectionParams(min_pattern_size=2, max_pattern_size=3, min_count=3).repeats(
        [7] * 5, 5
    )
    assert RepetitionDetectionParams(min_pattern_size=2, max_pattern_size=3, min_count=3).repeats([7] * 6, 6)
    assert not RepetitionDetectionParams().repeats([7] * 9, 9)  # off


@pytest.mark.parametrize(
    "fields", [{"max_pattern_size": 2}, {"max_pattern_size": 2, "min_count": 1}, {"min_pattern_size": 3}]
)
def test_repetition_detection_refuses_what_cannot_detect(fields: dict) -> None:
    with pytest.raises(ValueError, match=r"^repetition_detection needs"):
        RepetitionDetectionParams(**fields)
