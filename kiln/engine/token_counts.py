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
    pass over them), and freed when the sequence finishes. Row 0 stays zero: a step's rows that use no
    penalty read it.

    The rows are made all at once, at the first penalty: one per sequence a step can hold, plus row 0
    (`nbytes`, which the GPU's memory profile sets aside). A sequence that is not in the step (preempted)
    gives its row up when a step needs one; it is rebuilt from its ids when it samples again.

    Nothing here reads the device or copies to it from pageable memory (async scheduling's overlap), which
    rules out writing a Python scalar through an index tensor and index_put_ with accumulate on CUDA:
    both synchronize the stream (torch 2.11)."""

    def __init__(self, vocab_size: int, device: torch.device, max_seqs: int) -> None:
        self.vocab_size, self.device, self.max_seqs = vocab_size, device, max_seqs
        self.prompt = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(1, vocab_size, dtype=torch.int32, device=device)
        self.rows: dict[Request, int] = {}
        self.free: list[int] = []
        self._step: tuple[torch.Tensor, torch.Tensor] | None = None  # (batch positions, rows) to update

    @staticmethod
    def nbytes(vocab_size: int, max_seqs: int) -> int:
        """The rows' memory once a penalty has been used: a prompt mask (bool) and counts (int32) each."""
        return (max_seqs + 1) * vocab_size * (torch.bool.itemsize + torch.int32.itemsize)

    def penalties(
        self, reqs: list[Request], ahead: tuple[list[int], list[int]] | None = None
    ) -> Penalties | None:
        """The step's penalties for the sampled rows' reqs in order, or None when none uses one. Rows that
        use no penalty read zeros (and are left out of update), as do requests that finished since the step
        was scheduled (async scheduling: a stop string found while landing the last step), whose tokens are
        dropped. ahead: (rows, token ids) counted on those rows for this step only (a draft, on the rows
        after it: speculative decoding)."""
        users = [i for i, r in enumerate(reqs) if r.params.uses_penalties and not r.finished]
        if not users:
            self._step = None
            return None
        for r in [r for r in self.rows if r.finished]:
            self.free.append(self.rows.pop(r))
        for i in users:
            if reqs[i] not in self.rows:
                self._admit(reqs[i], reqs)
        index = to_device([self.rows.get(r, 0) for r in reqs], torch.int64, self.device)
        prompt, counts = self.prompt[index], self.counts[index]  # copies: the step may not change the rows
        if ahead is not None and ahead[0]:
            cells = to_device(ahead[0], torch.int64, self.device) * self.vocab_size
            cells += to_device(ahead[1], torch.int64, self.device)
            counts.view(-1).scatter_add_(0, cells, torch.ones_like(cells, dtype=torch.int32))
        positions = to_device(users, torch.int64, self.device)
        self._step = (positions, index[positions])
        return Penalties.build([r.params for r in reqs], prompt, counts)

    def update(self, token_ids: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """Counts the tokens just sampled for the rows of the last penalties() call; kept: which rows' tokens
        their sequences keep (speculative decoding), else all."""
        if self._step is None:
            return
        positions, rows = self._step
        cells = rows * self.vocab_size + token_ids[positions]
        ones = torch.ones_like(cells, dtype=torch.int32) if kept is None else kept[positions].to(torch.int32)
        self.counts.view(-1).scatter_add_(0, cells, ones)

    def _admit(self, req: Request, step: list[Request]) -> None:
        if len(self.prompt) == 1:
            self.prompt = self.prompt.new_zeros(self.max_seqs + 1, self.vocab_size)
            self.counts = self.counts.new_zeros(self.max_seqs + 1, self.vocab_size)
            self.free = list(range(self.max_seqs, 0, -1))
        if not self.free:
            in_step = set(step)
            self.free.append(self.rows.pop(next(r for r in self.rows if r not in in_step)))
        row = self.rows[req] = self.free.pop()
        # An embeddings prompt has no tokens to penalize: its ids are placeholders.
        ids = [req.prompt_token_ids if req.prompt_embeds is None else [], req.output_token_ids]
        counts = token_counts(ids, self.vocab_size, self.device)
        self.prompt[row] = counts[0] > 0
        self.counts[row] = counts[1]
