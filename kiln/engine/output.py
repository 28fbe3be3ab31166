"""Each step's sampled tokens into request outputs: logprob formatting, detokenizing, stop checks, and the
outputs themselves, as deltas (the tokens, logprobs and text new since the last output). A step's work
here is proportional to the tokens it produced, never to a request's history."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.engine.request import Logprob, PositionLogprobs, Request
from kiln.engine.request_output import CompletionOutput, RequestOutput
from kiln.engine.speculative import DraftStats
from kiln.engine.step_result import StepResult

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Parent:
    """A user request; with n > 1 it fans out into n sampled sequences that share the prompt."""

    request_id: str
    prompt: str | None
    children: list[Request]
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def output(self, advanced: list[Request], whole: bool) -> RequestOutput:
        """The advanced sequences' deltas; or (whole) every sequence's whole output."""
        first = self.children[0]
        # Once the first sequence has sampled, its prompt is scored whole: sent once, from then on.
        prompt_logprobs = None if self.sent_prompt_logprobs else first.prompt_logprobs
        self.sent_prompt_logprobs = first.num_output_tokens > 0
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[
                _sequence_output(i, c, whole) for i, c in enumerate(self.children) if whole or c in advanced
            ],
            finished=self.finished,
            num_cached_tokens=max(0, first.num_cached_tokens),
            scheduled_at=first.scheduled_at,
        )


def _sequence_output(index: int, req: Request, whole: bool) -> CompletionOutput:
    start = 0 if whole else req.num_sent_tokens
    req.num_sent_tokens = req.num_output_tokens
    return CompletionOutput(
        index=index,
        text=req.text.whole() if whole else req.text.delta(),
        token_ids=req.token_ids[req.num_prompt_tokens + start :],
        cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
        logprobs=req.logprobs[start:] if req.logprobs is not None else None,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
    )


class TokenWords:
    """Each token's own text, as logprobs show it; decoded once per token id and remembered. Without a
    tokenizer (skip_tokenizer_init), a token is named by its id, as return_tokens_as_token_ids names it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.words: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> list[str]:
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in ids]
        missing = list({t for t in ids if t not in self.words})
        if missing:
            self.words.update(zip(missing, self.tokenizer.batch_decode([[t] for t in missing]), strict=True))
        return [self.words[t] for t in ids]

    def logprob_dicts(
        self, ids: list[list[int]], logprobs: list[list[float]], ranks: list[int], ks: list[int]
    ) -> list[PositionLogprobs]:
        """Rows of (token, then top-k) -> {token id: Logprob}, keeping each row's own k."""
        out = []
        for row_ids, row_lps, rank, k in zip(ids, logprobs, ranks, ks, strict=True):
            words = self(row_ids[: 1 + k])
            entry = {row_ids[0]: Logprob(row_lps[0], rank, words[0])}
            for j in range(1, 1 + k):
                entry.setdefault(row_ids[j], Logprob(row_lps[j], j, words[j]))
            out.append(entry)
        return out


class OutputProcessor:
    """Owns the requests' outputs: `finish` (the scheduler's) frees a sequence that met a stop."""

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: set[int],
        finish: Callable[[Request], None],
        drafts: DraftStats | None = None,
    ) -> None:
        """drafts: speculative decoding's counters, kept up to date here."""
        self.words = TokenWords(tokenizer)
        self.drafts = drafts
        self.eos_token_ids = eos_token_ids
        self.finish = finish
        self.parents: dict[str, Parent] = {}

    def process(self, result: StepResult, final_only: bool) -> list[RequestOutput]:
        """The step's outputs: a delta per request it advanced; with final_only (vLLM's FINAL_ONLY
        output kind, for callers that don't stream) the whole outputs of the requests it finished. A request
        that finished while the step ran (async scheduling: a stop seen one step late, or an abort) drops
        what the step made for it."""
        result.wait()
        for req, pl in result.prompt_logprobs.items():
            if req.finished:
                continue
            assert req.prompt_logprobs is not None
            ks = [req.params.prompt_logprobs or 0] * len(pl.ranks)
            del req.prompt_logprobs[pl.first_position + 1 :]  # a preempted request scores its prompt again
            req.prompt_logprobs += self.words.logprob_dicts(
                pl.ids.tolist(), pl.logprobs.tolist(), pl.ranks.tolist(), ks
            )
        out = result.output
        if out is None:
            return self._pooled(result.pooled)
        tokens = out.token_ids.tolist()
        if out.logprobs is not None:
            ks = [r.params.logprobs or 0 for r in result.sampled]
            if result.spans is not None:
                ks = [k for k, w in zip(ks, result.spans.widths, strict=True) for _ in range(w)]
            rows = self.words.logprob_dicts(
                out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist(), ks
            )
        else:
            rows = []
        advanced: dict[str, list[Request]] = {}
        spans = result.spans
        if spans is None:
            for i, req in enumerate(result.sampled):
                req.num_pending -= 1
                if not req.finished:
                    self._take(req, tokens[i], rows[i] if rows else None)
                    advanced.setdefault(req.parent_id, []).append(req)
        else:
            row = 0
            for req, width, kept in zip(result.sampled, spans.widths, spans.kept.tolist(), strict=True):
                req.num_pending -= 1
                # The KV of the rows after its last kept draft holds drafts it did not keep: computed again.
                req.num_computed_tokens -= width - kept
                if self.drafts is not None:
                    self.drafts.record(width, kept)
                if not req.finished:
                    for j in range(row, row + kept):
                        self._take(req, tokens[j], rows[j] if rows else None)
                        if req.finished:
                            break
                    advanced.setdefault(req.parent_id, []).append(req)
                row += width
        outputs = []
        for parent_id, reqs in advanced.items():
            parent = self.parents[parent_id]
            if final_only and not parent.finished:
                continue
            outputs.append(parent.output(reqs, whole=final_only))
            if parent.finished:
                del self.parents[parent_id]
        return outputs

    def _pooled(self, pooled: dict[Request, torch.Tensor]) -> list[RequestOutput]:
        outputs = []
        for req, embedding in pooled.items():
            parent = self.parents.pop(req.parent_id, None)
            if parent is None:  # aborted while the step ran
                continue
            done = CompletionOutput(0, "", [], None, None, "stop", None)
            outputs.append(
                RequestOutput(
                    parent.request_id,
                    parent.prompt,
                    req.prompt_token_ids,
                    None,
                    [done],
                    True,
                    max(0, req.num_cached_tokens),
                    req.scheduled_at,
                    embedding,
                )
            )
        return outputs

    def _take(self, req: Request, token: int, logprobs: PositionLogprobs | None) -> None:
        """One sampled token into its sequence (which may end there)."""
        answer = req.thinking is None or req.thinking.advance(token)
        if answer and req.grammar is not None and (req.grammar.failed or not req.grammar.accept(token)):
            log.error("request %s: its grammar failed; it ends as aborted", req.request_id)
            req.finish_reason = "abort"
            req.text.settle(final=True)
            self.finish(req)
            return
        req.token_ids.append(token)
        if logprobs is not None and req.logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs[token].logprob
        self._check_stop(req, token)

    def _check_stop(self, req: Request, token: int) -> None:
        p = req.params
        reason: tuple[str, int | str | None] | None = None
        # A grammar that has ended was let end before min_tokens (Grammars.keep_ends).
        if req.num_output_tokens >= p.min_tokens or (req.grammar is not None and req.grammar.ended):
            if not p.ignore_eos and token in self.eos_token_ids:
                reason = ("stop", None)
            elif token in req.stop_ids:
                reason = ("stop", token)
        # As vLLM: the text of a stop token is left out unless include_stop_str_in_output.
        if reason is None or p.include_stop_str_in_output:
            new_text = req.text.add(token)
            if reason is None and p.stop and req.num_output_tokens >= p.min_tokens:
                hit = req.text.find_stop(len(new_text), p.stop, p.include_stop_str_in_output)
                if hit is not None:
                    reason = ("stop", hit)
        if reason is None and req.num_output_tokens >= req.max_tokens:  # (max_tokens fits max_model_len)
            reason = ("length", None)
        detect = p.repetition_detection
        if (
            reason is None
            and detect is not None
            and req.num_output_tokens >= p.min_tokens
            and detect.repeats(req.token_ids, req.num_output_tokens)
        ):
            reason = ("repetition", "repetition_detected")  # vLLM's
        if reason is not None:
            req.finish_reason, req.stop_reason = reason
            req.text.settle(final=True)
            self.finish(req)
        else:
            req.text.settle(final=False)
