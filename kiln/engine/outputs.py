from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.engine.request import Logprob, PositionLogprobs, Request


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0


def visible_text(req: Request) -> str:
    """While running, text that may still turn out to begin a stop string is held back, so a stream
    never shows what the final, trimmed text leaves out."""
    if req.finished or not req.params.stop:
        return req.text
    hold = max(map(len, req.params.stop)) - 1
    return req.text[: max(0, len(req.text) - hold)]


def logprob_dicts(
    tokenizer: Any, ids: list[list[int]], logprobs: list[list[float]], ranks: list[int], ks: list[int]
) -> list[PositionLogprobs]:
    """Rows of (token, then top-k) -> {token id: Logprob}, keeping each row's own k."""
    out = []
    for row_ids, row_lps, rank, k in zip(ids, logprobs, ranks, ks, strict=True):
        words = tokenizer.batch_decode([[t] for t in row_ids[: 1 + k]])
        entry = {row_ids[0]: Logprob(row_lps[0], rank, words[0])}
        for j in range(1, 1 + k):
            entry.setdefault(row_ids[j], Logprob(row_lps[j], j, words[j]))
        out.append(entry)
    return out


@dataclass(slots=True)
class Parent:
    """A user request; with n > 1 it fans out into n sampled sequences that share the prompt."""

    request_id: str
    prompt: str | None
    children: list[Request]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def output(self) -> RequestOutput:
        """The cumulative output so far (copies of each sequence's tokens and logprobs)."""
        first = self.children[0]
        outputs = [
            CompletionOutput(
                index=i,
                text=visible_text(c),
                token_ids=c.output_token_ids,
                cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, c in enumerate(self.children)
        ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=max(0, first.num_cached_tokens),
        )
