"""Beam search as vLLM runs it, over ordinary requests: each step asks for every beam's 2 x width most
likely next tokens (a one-token greedy request with logprobs, its prompt the beam so far, which the prefix
cache mostly holds already), keeps the width best continuations by cumulative logprob, and sets aside
each one that ends in EOS. After max_tokens steps, the width best of the finished and the running beams by
cumulative logprob / length ** length_penalty (the length counts the prompt, as vLLM's does). The scores
are the model's own logprobs, so there is no temperature. A driver (LLM.beam_search, the server) runs the
steps' requests; this holds the beams."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kiln.engine.request import PositionLogprobs
from kiln.engine.request_output import RequestOutput
from kiln.sampling_params import SamplingParams

MAX_BEAM_WIDTH = 10  # 2 x width logprobs a step, within the engine's default --max-logprobs 20 (vLLM's too)


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """vLLM's, less its temperature (see above)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # a final EOS stays in the tokens
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    def step_params(self, logprobs: int = 0) -> SamplingParams:
        """A step's request for one beam: its top tokens (2 x width, or more logprobs to report)."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=max(2 * self.beam_width, logprobs))


@dataclass(slots=True)
class BeamSearchSequence:
    tokens: list[int]  # prompt + output, as vLLM's
    logprobs: list[PositionLogprobs]  # one per output token
    cum_logprob: float = 0.0
    finish_reason: str = "length"  # "stop": it ended in EOS
    stop_reason: int | None = None  # that EOS
    text: str = ""  # filled in by the driver


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the best first


@dataclass(slots=True)
class BeamSearch:
    """One prompt's beams: those still running, and those ended by EOS."""

    prompt: list[int]
    params: BeamSearchParams
    eos: frozenset[int]
    cache_salt: str | None = None  # the prompt's, for each step's requests
    beams: list[BeamSearchSequence] = field(init=False)
    done: list[BeamSearchSequence] = field(default_factory=list)
    steps: int = 0
    num_cached_tokens: int = 0  # of the prompt, in the first step

    def __post_init__(self) -> None:
        self.beams = [BeamSearchSequence(self.prompt, [])]

    @property
    def running(self) -> bool:
        return bool(self.beams) and self.steps < self.params.max_tokens

    def advance(self, outs: list[RequestOutput]) -> None:
        """Takes each beam's step output (in the order of `beams`): the width best continuations run on."""
        p = self.params
        if self.steps == 0:
            self.num_cached_tokens = outs[0].num_cached_tokens
        self.steps += 1
        if any(o.outputs[0].finish_reason == "abort" for o in outs):
            for b in self.beams:
                b.finish_reason = "abort"
            self.done += self.beams
            self.beams = []
            return
        candidates: list[tuple[float, int, BeamSearchSequence, PositionLogprobs]] = []
        for beam, out in zip(self.beams, outs, strict=True):
            entry = out.outputs[0].logprobs[0]  # type: ignore[index]
            for token, lp in entry.items():
                score = beam.cum_logprob + lp.logprob
                if token in self.eos and not p.ignore_eos:
                    kept = [token] if p.include_stop_str_in_output else []
                    logprobs = beam.logprobs + [entry] * len(kept)
                    self.done.append(BeamSearchSequence(beam.tokens + kept, logprobs, score, "stop", token))
                else:
                    candidates.append((score, token, beam, entry))
        candidates.sort(key=lambda c: c[0], reverse=True)
        self.beams = [
            BeamSearchSequence([*b.tokens, t], [*b.logprobs, e], s)
            for s, t, b, e in candidates[: p.beam_width]
        ]

    def best(self) -> list[BeamSearchSequence]:
        """The width best of all beams, finished or not, the best first."""
        return sorted(self.done + self.beams, key=self._score, reverse=True)[: self.params.beam_width]

    def _score(self, beam: BeamSearchSequence) -> float:
        """transformers' and vLLM's: the cumulative logprob over the length, a final EOS not counted."""
        length = len(beam.tokens) - (beam.tokens[-1] in self.eos)
        return beam.cum_logprob / max(length, 1) ** self.params.length_penalty


def step_prompts(running: list[BeamSearch]) -> list[list[int]]:
    """The running searches' beams, each a one-token request's prompt, in the order advance_all takes
    their outputs back."""
    return [beam.tokens for search in running for beam in search.beams]


def advance_all(running: list[BeamSearch], outs: list[RequestOutput]) -> None:
    """Each running search takes its beams' outputs from one step's: search by search, beam by beam (the
    order of step_prompts)."""
    start = 0
    for search in running:
        n = len(search.beams)
        search.advance(outs[start : start + n])
        start += n
