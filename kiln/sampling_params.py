from __future__ import annotations

from typing import Any, Literal

import msgspec

_GREEDY_EPS = 1e-5


class StructuredOutputsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One constraint on a sequence's text, as vLLM names them: a JSON schema (`json`), any JSON object
    (`json_object`), a regular expression, one of a list of strings (`choice`), an EBNF `grammar`, or
    xgrammar's `structural_tag` (as JSON: free text, with tagged parts held to their schemas)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False  # JSON without whitespace between its tokens

    def __post_init__(self) -> None:
        kinds = ("json", "regex", "choice", "grammar", "structural_tag")
        given = [k for k in kinds if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object and "
                f"structural_tag, got {given or 'none'}"
            )


class RepetitionDetectionParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's: the output ends (finish_reason "repetition") once its last min_count x L tokens are one
    L-token pattern repeated, for some L in [min_pattern_size, max_pattern_size]."""

    max_pattern_size: int = 0  # 0: off
    min_pattern_size: int = 0  # 0: 1
    min_count: int = 0

    def __post_init__(self) -> None:
        low, high = self.min_pattern_size, self.max_pattern_size
        if low < 0 or high < 0 or low > high:
            raise ValueError(
                "repetition_detection needs max_pattern_size and min_pattern_size >= 0, with "
                "min_pattern_size <= max_pattern_size (both 0 turn it off)"
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError("repetition_detection needs min_count >= 2 to detect a repetition")

    def repeats(self, tokens: list[int], num_output: int) -> bool:
        """Whether the output (the last num_output of tokens) ends in a pattern repeated min_count times.
        Reads at most max_pattern_size x min_count tokens, however long the output."""
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            span = size * self.min_count
            if span > num_output:
                return False
            tail = tokens[-span:]
            if tail == tail[:size] * self.min_count:
                return True
        return False


class SamplingParams(msgspec.Struct, kw_only=True):
    """What a request asks of decoding; names and defaults follow vLLM's."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # the only tokens it may sample
    bad_words: list[str] = msgspec.field(default_factory=list)  # words it may not generate
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # False: a special token after another gets no space
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: as many as fit
    truncation_side: Literal["left", "right"] = "left"  # right: keep the first k instead
    repetition_detection: RepetitionDetectionParams | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # A reasoning model's thinking, in tokens, before its closing tag is forced (kiln.engine.thinking);
    # None (-1 as given): no limit.
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0.0, "must be non-negative"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1 (disable), 0 (disable) or at least 1"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be greater than zero"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "must be less than or equal to max_tokens",
            ),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be non-negative"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "must be non-negative",
            ),
            ("stop", all(s for s in self.stop), "must not contain empty strings"),
            (
                "allowed_token_ids",
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "must not be empty",
            ),
            ("bad_words", all(w.strip() for w in self.bad_words), "must not contain empty words"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must fit in 64 bits"),
            (
                "thinking_token_budget",
                self.thinking_token_budget is None or self.thinking_token_budget >= -1,
                "must be a non-negative integer or -1 for unlimited",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
        check_truncation(self.truncate_prompt_tokens)
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def top_k_or_off(self) -> int:
        return self.top_k if self.top_k > 0 else 0


def truncate_prompt(
    ids: list[int],
    keep: int | None,
    max_tokens: int | None,
    max_model_len: int,
    side: Literal["left", "right"] = "left",
) -> list[int]:
    """The prompt's last `keep` tokens (side "left", vLLM's default: cut from the left), or its first
    (side "right"); keep -1: as many as leave room for max_tokens (for one token when unset; 0 for an
    embedding, which generates none) within max_model_len."""
    check_truncation(keep)
    if keep is None:
        return ids
    if keep == -1:
        keep = max(max_model_len - (1 if max_tokens is None else max_tokens), 1)
    return ids[-keep:] if side == "left" else ids[:keep]


def check_truncation(keep: int | None) -> None:
    if keep is not None and keep != -1 and keep < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep!r}")
