"""What the engine hands out for a request: its sequences' outputs (deltas, or whole), as vLLM's
RequestOutput and CompletionOutput."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kiln.engine.request import PositionLogprobs


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
    """A step's delta of one request (the sequences it advanced, and what is new in each), or with
    LLMEngine.step(final_only=True) the whole finished request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None  # in a request's first output only
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    scheduled_at: float = 0.0  # time.monotonic() when first scheduled (0: not yet)
    embedding: torch.Tensor | None = None  # an embedding request's (float32, on the host)


def merge(deltas: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one output (a reader that fell behind, or a whole request)."""
    if len(deltas) == 1:
        return deltas[0]
    by_index: dict[int, list[CompletionOutput]] = {}
    for d in deltas:
        for c in d.outputs:
            by_index.setdefault(c.index, []).append(c)
    outputs = []
    for index in sorted(by_index):
        parts, last = by_index[index], by_index[index][-1]
        logprobs = [c.logprobs for c in parts]
        outputs.append(
            CompletionOutput(
                index=index,
                text="".join(c.text for c in parts),
                token_ids=list(itertools.chain.from_iterable(c.token_ids for c in parts)),
                cumulative_logprob=last.cumulative_logprob,
                logprobs=None if logprobs[0] is None else list(itertools.chain.from_iterable(logprobs)),
                finish_reason=last.finish_reason,
                stop_reason=last.stop_reason,
            )
        )
    first, last = deltas[0], deltas[-1]
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return RequestOutput(
        first.request_id, first.prompt, first.prompt_token_ids, prompt_logprobs, outputs, last.finished,
        last.num_cached_tokens, last.scheduled_at, last.embedding,
    )  # fmt: skip
