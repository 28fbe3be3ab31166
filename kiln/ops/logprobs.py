"""The logprob rows a step reports: each row's token, its value and rank, then the top k."""

from __future__ import annotations

from collections.abc import Callable

import torch


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int, as_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of logits [N,V] (as_logits: the logits themselves); returns (ids [N,1+k], values
    [N,1+k], ranks [N]).

    Each row lists the given token first, then the top-k; rank is 1 + the number of tokens with a
    strictly greater value.
    """
    logprobs = logits.float() if as_logits else logits.float().log_softmax(dim=-1)
    token_ids = token_ids.long()[:, None]
    chosen = logprobs.gather(-1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([token_ids, top_ids], dim=1), torch.cat([chosen, top_values], dim=1), ranks


def logprobs_in_chunks(
    logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, token_ids: torch.Tensor, k: int,
    rows: int, as_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """compute_logprobs of hidden states' logits, `rows` at a time: a chunk's logits, log-softmax and
    comparison take 9 bytes a vocabulary entry (2.8 GB for 2,048 rows at a vocabulary of 152k). The runner
    takes max_num_seqs rows, below the sampler's largest draw, which the GPU memory profile counts."""
    parts = [
        compute_logprobs(logits_of(hidden[a : a + rows]), token_ids[a : a + rows], k, as_logits)
        for a in range(0, len(hidden), rows)
    ]
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))  # type: ignore[return-value]
