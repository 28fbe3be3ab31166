"""What the penalties read of each sequence, kept on the device and brought up to date by each step's new
tokens, so a step's sampling work never grows with the length of a sequence."""

from __future__ import annotations

import torch

from kiln.engine.request import Request
from kiln.ops.sampling_metadata import Penalties, token_counts
from kiln.ops.transfer import to_device


class TokenCounts:
    """One row per sequence that uses a penalty: the set of its prompt's tokens, and how often each token
    occurs in its output. A row is built from the sequence's ids once, when it first samples (its only
    pass over them), and freed when the sequence finishes; the rows grow by doubling. Row 0 stays zero:
    a step's rows that use no penalty read it.

    Nothing here reads the device or copies to it from pageable memory (async scheduling's overlap), which
    rules out writing a Python scalar through an index tensor and index_put_ with accumulate on CUDA:
    both synchronize the stream (torch 2.11)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.prompt = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(1, vocab_size, dtype=torch.int32, device=device)
        self.rows: dict[Request, int] = {}
        self.free: list[int] = []
        self._step: tuple[torch.Tensor, torch.Tensor] | None = None  # (batch positions, rows) to update

    def penalties(self, reqs: list[Request]) -> Penalties | None:
        """The step's penalties for the sampled reqs in order, or None when none uses one. Rows that use no
        penalty read zeros (and are left out of update)."""
        users = [i for i, r in enumerate(reqs) if r.params.uses_penalties]
        if not users:
            self._step = None
            return None
        for r in [r for r in self.rows if r.finished]:
            self.free.append(self.rows.pop(r))
        for i in users:
            if reqs[i] not in self.rows:
                self._admit(reqs[i])
        index = to_device([self.rows.get(r, 0) for r in reqs], torch.int64, self.device)
        prompt, counts = self.prompt[index], self.counts[index]  # copies: the step may not change the rows
        positions = to_device(users, torch.int64, self.device)
        self._step = (positions, index[positions])
        return Penalties.build([r.params for r in reqs], prompt, counts)

    def update(self, token_ids: torch.Tensor) -> None:
        """Counts the tokens just sampled for the reqs of the last penalties() call."""
        if self._step is None:
            return
        positions, rows = self._step
        cells = rows * self.vocab_size + token_ids[positions]
        self.counts.view(-1).scatter_add_(0, cells, torch.ones_like(cells, dtype=torch.int32))

    def _admit(self, req: Request) -> None:
        if not self.free:
            n = len(self.prompt)
            grow = max(8, n)
            self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(grow, self.vocab_size)])
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab_size)])
            self.free = list(range(n + grow - 1, n - 1, -1))
        row = self.rows[req] = self.free.pop()
        ids = [req.prompt_token_ids, req.output_token_ids]
        counts = token_counts(ids, self.vocab_size, self.device)
        self.prompt[row] = counts[0] > 0
        self.counts[row] = counts[1]
