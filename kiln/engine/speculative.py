"""Prompt-lookup drafting (vLLM's ngram speculative method): a decoding request's last n tokens are looked
up earlier in its prompt and output, and the tokens that followed them there are its drafts, all checked
by the model in one step."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kiln.ops.transfer import to_device
from kiln.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from kiln.engine.request import Request


class NgramIndex:
    """Where each n-gram of one sequence (prompt_lookup_min <= n <= prompt_lookup_max) first occurs, kept up
    to date as its tokens arrive: a lookup costs the tokens new since the last one, never the sequence's
    length (vLLM searches the whole sequence each step)."""

    __slots__ = ("first", "min_n", "size")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.first: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self.size = 0  # tokens indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the earliest earlier occurrence of the longest n-gram that ends
        `tokens` (vLLM's choice); none where no such n-gram occurs before."""
        total = len(tokens)
        for end in range(max(self.size + 1, self.min_n), total + 1):
            for n, first in enumerate(self.first, self.min_n):
                if n > end:
                    break
                first.setdefault(tuple(tokens[end - n : end]), end - n)
        self.size = total
        for n in range(self.min_n + len(self.first) - 1, self.min_n - 1, -1):
            if n > total:
                continue
            start = self.first[n - self.min_n][tuple(tokens[total - n :])] + n
            if start < total:
                return tokens[start : start + k]
        return []


class Drafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.num_speculative_tokens and config.prompt_lookup_min and config.prompt_lookup_max
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.stats = DraftStats(accepted_per_pos=[0] * self.k)  # the output processor counts what is kept
        schedule = config.num_speculative_tokens_per_batch_size or [(1, 1, self.k)]
        self.starts = [start for start, _, _ in schedule]
        self.ks = [min(k, self.k) for _, _, k in schedule]

    def k_for(self, batch_size: int) -> int:
        """The most drafts a request takes in a step of batch_size running requests: its range's k, or past
        a range, the k of the range before (vLLM's dynamic schedule)."""
        return self.ks[bisect.bisect_right(self.starts, max(batch_size, 1)) - 1]

    def propose(self, req: Request, room: int) -> list[int]:
        """At most `room` drafts for a request whose next step samples its next token (none where its
        sampling reads its tokens one at a time, or where no more fit its max_tokens)."""
        k = min(room, req.max_tokens - req.num_output_tokens - 1)
        if k <= 0 or not req.drafts_ok:
            return []
        if req.ngrams is None:
            req.ngrams = NgramIndex(self.min_n, self.max_n)
        return req.ngrams.propose(req.token_ids, k)


@dataclass(slots=True)
class DraftStats:
    """vLLM's spec_decode counters: steps' drafting requests, their drafts, the drafts kept, and the drafts
    kept at each position (of num_speculative_tokens)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, width: int, kept: int) -> None:
        """One request's check: width - 1 drafts, of which kept - 1 held."""
        if width == 1:
            return
        self.num_drafts += 1
        self.num_draft_tokens += width - 1
        self.num_accepted_tokens += kept - 1
        for pos in range(kept - 1):
            self.accepted_per_pos[pos] += 1


@dataclass(slots=True)
class Spans:
    """A step that checked drafts: each sampled request's rows (1 + its drafts), and how many of those rows'
    tokens it keeps."""

    widths: list[int]
    kept: torch.Tensor  # [requests] int64
    kept_rows: torch.Tensor  # [rows] bool: the rows whose tokens are kept


def check_drafts(tokens: torch.Tensor, drafts: list[list[int]]) -> Spans:
    """Speculative decoding's check, for drafts that are one token each (prompt lookup): each row's
    token was drawn from the model's distribution there, so a request keeps its drafts up to the first
    whose row drew another token, and that row's token. Accepting a draft d with probability p(d), and
    otherwise drawing from p without d, is rejection sampling against a draft that puts all its mass on
    d: the kept tokens are distributed exactly as drawn one step at a time."""
    widths = [1 + len(d) for d in drafts]
    device, width = tokens.device, max(widths)
    first = np.cumsum(widths) - widths
    take = np.minimum(np.arange(width)[None, :], np.asarray(widths)[:, None] - 1) + first[:, None]
    expected = np.full((len(widths), width), -1, dtype=np.int64)
    for i, d in enumerate(drafts):
        expected[i, : len(d)] = d
    agree = tokens[to_device(take, None, device)] == to_device(expected, None, device)
    kept = agree.cumprod(dim=1).sum(dim=1) + 1
    place = to_device(np.arange(len(tokens)) - np.repeat(first, widths), None, device)  # within its request
    # (output_size: a CUDA repeat_interleave would otherwise read the sizes back, a stream sync.)
    repeats = to_device(np.asarray(widths, dtype=np.int64), None, device)
    return Spans(widths, kept, place < kept.repeat_interleave(repeats, output_size=len(tokens)))


def drafts_ahead(sampled: list[Request], drafts: list[list[int]]) -> tuple[list[int], list[int]]:
    """For the penalties: (row, token) for each draft of a request that uses one, on each of its rows after
    the draft (a row's token follows its drafts before it)."""
    rows: list[int] = []
    tokens: list[int] = []
    first = 0
    for r, d in zip(sampled, drafts, strict=True):
        if d and r.params.uses_penalties:
            for j in range(1, 1 + len(d)):
                rows += [first + j] * j
                tokens += d[:j]
        first += 1 + len(d)
    return rows, tokens


def draft_rows(last: np.ndarray, drafts: list[list[int]]) -> np.ndarray:
    """Each request's logits rows in the flat batch, in order: its last 1 + len(drafts) tokens', the final
    one at `last`."""
    w = np.asarray([1 + len(d) for d in drafts])
    first = np.repeat(last - w + 1, w)
    return first + np.arange(w.sum()) - np.repeat(np.cumsum(w) - w, w)
