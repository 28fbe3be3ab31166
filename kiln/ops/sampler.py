"""Batched token sampling following vLLM: penalties, temperature, min-p, top-k, top-p, logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.config import LogprobsMode
from kiln.ops.logprobs import compute_logprobs
from kiln.ops.sampling_metadata import SamplingMetadata
from kiln.ops.transfer import to_device


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None  # [B, 1 + max_logprobs] int64: sampled token, then top-k ids
    logprobs: torch.Tensor | None  # [B, 1 + max_logprobs] float32, same order
    ranks: torch.Tensor | None  # [B] int64: rank of the sampled token (1 = most likely)


# The sampler's two stages: penalties, bias and temperature; then the filters and the random draw.
Prepare = Callable[[torch.Tensor, "SamplingMetadata"], torch.Tensor]
Draw = Callable[[torch.Tensor, "SamplingMetadata", torch.Generator | None], torch.Tensor]
# The structured-output mask, in place: (logits, token bitmask, its rows).
Mask = Callable[[torch.Tensor, torch.Tensor, list[int]], None]
# Each row's first maximum: [B, V] float32 -> [B] int64.
Argmax = Callable[[torch.Tensor], torch.Tensor]


def argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class Sampler:
    """prepare: penalties, bias and temperature (prepare_logits or its Triton kernel); draw: min-p, top-k,
    top-p and the random draw (draw below, or FlashInfer's sort-free kernels); mask: a grammar's token
    bitmask (xgrammar's kernel, or kiln's on the CPU); argmax: greedy rows' exact argmax (torch's, or kiln's
    on the CPU); logprobs_mode: what logprobs report."""

    def __init__(
        self,
        generator: torch.Generator | None = None,
        prepare: Prepare | None = None,
        draw: Draw | None = None,
        mask: Mask | None = None,
        argmax: Argmax = argmax,
        logprobs_mode: LogprobsMode = "raw_logprobs",
    ) -> None:
        self.generator = generator  # for rows without a seed; None means torch's default
        self.prepare = prepare or prepare_logits
        self.draw = draw or draw_tokens
        self.mask = mask or apply_bitmask
        self.argmax = argmax
        self.logprobs_mode = logprobs_mode
        self.processed = logprobs_mode.startswith("processed")
        self.as_logits = logprobs_mode.endswith("logits")

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: the step's own (a grammar masks them in place, so logprobs see only allowed tokens, as
        in vLLM); the rest works on a copy, and logprobs come from the logits before it."""
        if meta.allowed is not None:
            self.mask(logits, *meta.allowed)
        # All greedy with no penalty or bias: preparing would copy the logits and divide by 1. Bans and
        # allowed ids (min_tokens, bad_words) then go on the step's own logits, unless logprobs read them.
        masks = meta.banned is not None or meta.only is not None
        plain = (
            meta.all_greedy
            and meta.penalties is None
            and meta.logit_bias is None
            and not (masks and meta.want_logprobs)
        )
        processed = logits if plain else self.prepare(logits, meta)
        if plain and meta.banned is not None:
            processed[meta.banned] = processed.new_full((), float("-inf"))
        if meta.only is not None:
            keep_only(processed, *meta.only)
        token_ids = self.argmax(processed)
        if not meta.all_greedy:
            token_ids = torch.where(meta.greedy, token_ids, self.draw(processed, meta, self.generator))
        if not meta.want_logprobs:
            return SamplerOutput(token_ids, None, None, None)
        source = filtered(processed, meta) if self.processed else logits
        logprobs = compute_logprobs(source, token_ids, meta.max_logprobs, self.as_logits)
        return SamplerOutput(token_ids, *logprobs)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """-inf, in place, on the given rows' tokens whose bit is clear: xgrammar's kernel for the device
    (its CPU kernel, or Triton on CUDA)."""
    import xgrammar as xgr  # only once some request is constrained

    # Both through pinned memory: a pageable copy (xgrammar's own, of a list of rows) waits for the step's
    # forward, a stream sync.
    device = logits.device
    xgr.apply_token_bitmask_inplace(
        logits, to_device(bitmask.numpy(), None, device), indices=to_device(rows, torch.int32, device)
    )


def keep_only(logits: torch.Tensor, rows: torch.Tensor, which: torch.Tensor, ids: torch.Tensor) -> None:
    """allowed_token_ids, in place on prepared logits: -inf on the given rows but for their ids (ids[j] is
    allowed on rows[which[j]]). After penalties and temperature, which leave -inf as it is; logprobs, from
    the logits before, stay the model's own, as vLLM's."""
    keep = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[which, ids] = True
    logits[rows] = logits[rows].masked_fill_(~keep, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: drops tokens less likely than min_p times the row's most likely token (none where min_p is
    0). vLLM applies it to the whole distribution, before top-k and top-p (its MinPLogitsProcessor)."""
    # p < min_p * p_max, in logits: x - x_max < log(min_p) (-inf where off), no softmax needed.
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    return logits.masked_fill_(logits < threshold, float("-inf"))


def draw_tokens(
    logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None
) -> torch.Tensor:
    """Samples each row of prepared logits (modified in place) in vLLM's order: min-p on the whole
    distribution, then top-k, renormalise, top-p (on what min-p kept, renormalised). Each row takes one
    uniform number, not one a token (torch's exponential noise over a CPU's vocabulary cost more than a
    decode step); a seeded row's comes from its own generator, so its tokens don't depend on its batch."""
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p)
    uniform = torch.empty(len(logits), device=logits.device)
    if len(meta.seeded) < len(logits):
        uniform.uniform_(generator=generator)
    for row, own in meta.seeded.items():
        uniform[row : row + 1].uniform_(generator=own.generator)
    if meta.top_k is None and meta.top_p is None:
        return invert_cdf(logits.softmax(dim=-1), uniform)
    if logits.device.type == "cpu":
        return _draw_among_candidates(logits, meta.top_k, meta.top_p, uniform)
    return invert_cdf(_top_k_top_p(logits, meta.top_k, meta.top_p).softmax(dim=-1), uniform)


def filtered(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Prepared logits as the draw saw them: min-p (idempotent: the draw may have applied it in place),
    then top-k and top-p, -inf where they cut."""
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p)
    if meta.top_k is None and meta.top_p is None:
        return logits
    return _top_k_top_p(logits, meta.top_k, meta.top_p)


def invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token whose slice of the row's cumulative mass holds uniform x the mass: a token of no
    mass has an empty slice, and the row's last token with any mass bounds the pick (rounding)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    token = torch.searchsorted(cdf, uniform[:, None] * total, right=True)
    return torch.minimum(token, torch.searchsorted(cdf, total)).squeeze(1)


def prepare_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Everything before the draw, on an fp32 copy: penalties and bias, then temperature (1 on greedy rows,
    so their argmax is unchanged). The Triton sampling-prep kernel computes the same function."""
    return apply_penalties(logits.to(torch.float32, copy=True), meta).div_(meta.temperature[:, None])


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Banned ids, logit bias, then repetition/frequency/presence penalties; may modify logits in place.
    Written so that nothing synchronizes a GPU's stream: no Python scalar through an index tensor (a
    pageable copy to the device), no index_put_ with accumulate (it checks its indices on the host); a
    row's bias ids are distinct (a dict's keys), so a plain index add is the same sum."""
    if meta.banned is not None:
        logits[meta.banned] = logits.new_full((), float("-inf"))
    if meta.logit_bias is not None:
        rows, ids, values = meta.logit_bias
        logits[rows, ids] += values
    pen = meta.penalties
    if pen is not None:
        in_output = pen.output_counts > 0
        scale = torch.where(pen.prompt_mask | in_output, pen.repetition, 1.0)
        logits = torch.where(logits > 0, logits / scale, logits * scale)
        logits -= pen.frequency * pen.output_counts + pen.presence * in_output
    return logits


# The ranks a CPU examines, widening, for the top-k/top-p cut before it ranks a whole row: sorting 49k logits
# takes 2-5 ms a row there, finding the largest 256 of them 0.1-0.25 ms, 4,096 0.4-0.9 ms. A small model's
# nucleus at top-p 0.95 and temperature 1 held a median 181 tokens, and at the 90th percentile 2,340.
CANDIDATES = (256, 4096)


def _draw_among_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, uniform: torch.Tensor
) -> torch.Tensor:
    """The CPU's draw under top-k/top-p: each row's cut (_top_k_top_p's tokens, ties kept lowest id first
    as its stable sort keeps them) is found among its largest logits, widening, and the whole row where
    top-p's mass lies past them all; the row then draws among the ranks it kept, never touching the rest of
    its vocabulary again. Each row by the same arithmetic at any width: neither its cut nor its token
    depends on its batch."""
    rows, vocab = logits.shape
    k = top_k if top_k is not None else torch.full((rows,), vocab, dtype=torch.int64)
    p = top_p if top_p is not None else torch.ones(rows)
    token = torch.empty(rows, dtype=torch.int64)
    filtered = (k < vocab) | (p < 1.0)
    whole = (~filtered).nonzero()[:, 0]  # rows without a filter, beside some with one
    if len(whole):
        token[whole] = invert_cdf(logits[whole].softmax(dim=-1), uniform[whole])
    todo = filtered.nonzero()[:, 0]
    by_k = k[k < vocab]
    widest_k = int(by_k.max()) if len(by_k) else 0
    # A row with top-k is cut within its k largest; only top-p alone needs the candidates.
    widths = (*CANDIDATES, vocab) if bool(((k == vocab) & (p < 1.0)).any()) else (0,)
    for width in widths:
        if not len(todo):
            break
        x = logits if len(todo) == rows else logits[todo]
        drawn, found = _draw_among(x, k[todo], p[todo], uniform[todo], min(vocab, max(width, widest_k)))
        token[todo[found]] = drawn[found]
        todo = todo[~found]
    return token


def _draw_among(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, uniform: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token, drawn among the ranks top-k then top-p keep of its `width` largest logits (width
    >= every row's top-k), and whether its cut lies within them (a top-p alone may not)."""
    vocab = logits.shape[-1]
    by_k, by_p = k < vocab, p < 1.0
    # One rank past the width: a cut at the width's edge still sees the logit after it.
    values, top = logits.topk(min(vocab, width + 1), dim=-1)  # descending
    rank = torch.arange(values.shape[-1])
    # Masses relative to the top token's; a prefix of a sequential cumsum is the same whatever the width.
    mass = (values - values[:, :1]).exp()
    keep = k.clamp_max(values.shape[-1])  # ranks kept
    found = torch.ones(len(logits), dtype=torch.bool)
    if bool(by_p.any()):
        cum = mass.cumsum(dim=-1)
        # The whole row's mass as 1 / its top token's softmax: a softmax reduces each row in one thread, a
        # sum would split a lone row across threads.
        row_mass = 1 / logits.softmax(dim=-1).gather(1, top[:, :1])[:, 0]
        top_k_mass = torch.where(by_k, cum.gather(1, (keep - 1)[:, None])[:, 0], row_mass)
        before = (cum - mass) / top_k_mass[:, None]
        nucleus = ((before < p[:, None]) & (rank < keep[:, None])).sum(-1)
        found = ~by_p | by_k | (nucleus < values.shape[-1]) | (width >= vocab)
        keep = torch.where(by_p, nucleus, keep)
    kept_mass = mass.masked_fill(rank >= keep[:, None], 0.0)
    token = top.gather(1, invert_cdf(kept_mass, uniform)[:, None]).squeeze(1)
    # Equal finite logits among the kept ranks or at the cut: topk orders them as it likes, so which of them
    # are kept, and which slice of the mass each takes, would follow its order. Such rows keep the lowest
    # ids of a tie and draw over the whole row, in id order.
    tied = (values[:, :-1] == values[:, 1:]) & (rank[:-1] < keep[:, None]) & (values[:, 1:] > float("-inf"))
    tied = tied.any(-1) & found
    if bool(tied.any()):
        last = values.gather(1, (keep - 1)[:, None])
        token[tied] = _draw_tied(logits[tied], keep[tied], last[tied], uniform[tied])
    return token, found


def _draw_tied(
    logits: torch.Tensor, keep: torch.Tensor, last: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """Rows whose `keep` ranks end at the logit `last` and tie: the logits above it, and the lowest ids of
    those equal to it, as many as the ranks left; drawn over the whole row."""
    above, equal = logits > last, logits == last
    kept = above | (equal & (equal.cumsum(-1) <= (keep - above.sum(-1))[:, None]))
    return invert_cdf(logits.masked_fill(~kept, float("-inf")).softmax(dim=-1), uniform)


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    # Filtering by rank in sorted order keeps exactly k tokens even when logits tie.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        rank = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(rank >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 for the top token, which always stays
        # Rows with top_p = 1 are skipped outright: rounding in the cumsum could cut their tail.
        cut = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits.masked_fill_(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
