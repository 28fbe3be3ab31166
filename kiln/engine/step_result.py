"""A launched step's results, and how they reach the host: from a GPU, through pinned copies the device
makes when it gets there, so the host can schedule the next step meanwhile (async scheduling)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.engine.request import Request
from kiln.engine.speculative import Spans
from kiln.ops.sampler import SamplerOutput


@dataclass(slots=True)
class PromptLogprobs:
    first_position: int  # prompt position whose *next* token the first row scores
    ids: torch.Tensor  # [n, 1 + k]
    logprobs: torch.Tensor  # [n, 1 + k]
    ranks: torch.Tensor  # [n]


@dataclass(slots=True)
class StepResult:
    """wait() before reading the tensors."""

    sampled: list[Request]  # requests that reached the end of their tokens and got a new one
    output: SamplerOutput | None
    prompt_logprobs: dict[Request, PromptLogprobs]  # this step's rows of prompt logprobs
    read_next: bool = False  # the next step's sampling reads its tokens on the host (Request.reads_output)
    done: torch.cuda.Event | None = None  # recorded after the copies; None where the host is the device
    pooled: dict[Request, torch.Tensor] = field(default_factory=dict)  # the embeddings its prompts ended
    spans: Spans | None = None  # where it checked drafts (speculative decoding)

    @classmethod
    def launched(
        cls,
        sampled: list[Request],
        out: SamplerOutput | None,
        prompt_logprobs: dict[Request, PromptLogprobs],
        read_next: bool = False,
        pooled: dict[Request, torch.Tensor] | None = None,
        spans: Spans | None = None,
    ) -> StepResult:
        """The results of a step just launched; nothing here waits for a GPU to run it."""
        pooled = pooled or {}
        on_gpu = (
            (out is not None and out.token_ids.is_cuda)
            or any(pl.ids.is_cuda for pl in prompt_logprobs.values())
            or any(v.is_cuda for v in pooled.values())
        )
        if not on_gpu:
            return cls(sampled, out, prompt_logprobs, read_next, None, pooled, spans)
        if out is not None:
            fields = (out.token_ids, out.logprob_token_ids, out.logprobs, out.ranks)
            out = SamplerOutput(*(None if t is None else _host(t) for t in fields))
        prompt_logprobs = {
            r: PromptLogprobs(pl.first_position, _host(pl.ids), _host(pl.logprobs), _host(pl.ranks))
            for r, pl in prompt_logprobs.items()
        }
        pooled = {r: _host(v) for r, v in pooled.items()}
        if spans is not None:
            spans = Spans(spans.widths, _host(spans.kept), spans.kept_rows)
        done = torch.cuda.Event()
        done.record()
        return cls(sampled, out, prompt_logprobs, read_next, done, pooled, spans)

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


def _host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy on the host, made when the device gets there: into pinned memory, as a copy
    into pageable memory would hold the host until then."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
