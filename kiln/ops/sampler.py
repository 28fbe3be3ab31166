"""Batched token sampling following vLLM: penalties, temperature, min-p, top-k, top-p, logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    on the CPU)."""

    def __init__(
        self,
        generator: torch.Generator | None = None,
        prepare: Prepare | None = None,
        draw: Draw | None = None,
        mask: Mask | None = None,
        argmax: Argmax = argmax,
    ) -> None:
        self.generator = generator  # for rows without a seed; None means torch's default
        self.prepare = prepare or prepare_logits
        self.draw = draw or draw_tokens
        self.mask = mask or apply_bitmask
        self.argmax = argmax

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: the step's own (a grammar masks them in place, so logprobs see only allowed tokens, as
        in vLLM); the rest works on a copy, and logprobs come from the logits before it."""
        if meta.allowed is not None:
            self.mask(logits, *meta.allowed)
        # All greedy with no penalty, bias or ban: preparing would copy the logits and divide by 1.
        plain = meta.all_greedy and meta.penalties is None and meta.logit_bias is None and meta.banned is None
        processed = logits if plain else self.prepare(logits, meta)
        token_ids = self.argmax(processed)
        if not meta.all_greedy:
            token_ids = torch.where(meta.greedy, token_ids, self.draw(processed, meta, self.generator))
        if not meta.want_logprobs:
            return SamplerOutput(token_ids, None, None, None)
        return SamplerOutput(token_ids, *compute_logprobs(logits, token_ids, meta.max_logprobs))


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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: drops tokens less likely than min_p times the row's most likely token (none where min_p is
    0). vLLM applies it to the whole distribution, before top-k and top-p (its MinPLogitsProcessor)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def draw_tokens(
    logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None
) -> torch.Tensor:
    """Samples each row of prepared logits (modified in place) in vLLM's order: min-p on the whole
    distribution, then top-k, renormalise, top-p (on what min-p kept, renormalised)."""
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = _top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)

    # argmax(p / q) with q ~ Exp(1) draws from p; a seeded row's noise comes only from its
    # own generator, so its tokens don't depend on the rest of the batch.
    noise = torch.empty_like(probs)
    if len(meta.seeded) < len(probs):
        noise.exponential_(generator=generator)
    for row, own in meta.seeded.items():
        noise[row].exponential_(generator=own.generator)
    # A zero draw would make 0 / 0 = nan on a filtered token, and argmax favours nan.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


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


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of logits [N,V]; returns (ids [N,1+k], logprobs [N,1+k], ranks [N]).

    Each row lists the given token first, then the top-k; rank is 1 + the number of tokens with a
    strictly greater logprob.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    token_ids = token_ids.long()[:, None]
    chosen = logprobs.gather(-1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([token_ids, top_ids], dim=1), torch.cat([chosen, top_values], dim=1), ranks


def logprobs_in_chunks(
    logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, token_ids: torch.Tensor, k: int,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """compute_logprobs of hidden states' logits, `rows` at a time: a chunk's logits, log-softmax and
    comparison take 9 bytes a vocabulary entry (2.8 GB for 2,048 rows at a vocabulary of 152k). The runner
    takes max_num_seqs rows, below the sampler's largest draw, which the GPU memory profile counts."""
    parts = [
        compute_logprobs(logits_of(hidden[a : a + rows]), token_ids[a : a + rows], k)
        for a in range(0, len(hidden), rows)
    ]
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))  # type: ignore[return-value]
