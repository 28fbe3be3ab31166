"""vLLM's capacity valves (scheduler.max_num_queued_reqs, max_num_queued_tokens): a request that would
overfill the queue is refused as it arrives, a 503 its client retries later or elsewhere."""

from __future__ import annotations

from kiln.config import SchedulerConfig

# Each limit's key, vLLM's label for its rejections, and what its 503 says of the engine.
REASONS = {
    "max_num_queued_reqs": "is currently busy and cannot accept new requests",
    "max_num_queued_tokens": "has reached its prefill token backlog limit",
}


class Overloaded(RuntimeError):
    def __init__(self, reason: str) -> None:
        what = REASONS[reason]
        super().__init__(f"The engine {what}. Please try again later or on a different instance.")
        self.reason = reason  # the limit: its key, vLLM's metric label


class QueueLimits:
    """What is in flight: sequences (a request runs n), and the prompt tokens of requests not yet past
    prefill (n times each, as vLLM counts its n sequences)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.max_seqs = config.max_num_queued_reqs
        self.max_prefill = config.max_num_queued_tokens
        self.seqs = 0
        self.prefill_tokens = 0

    def join(self, seqs: int, prompt_tokens: int) -> None:
        """Counts a request of this many sequences in, or raises Overloaded: vLLM compares the sequences
        with the newcomer's, the backlog without its prompt."""
        if self.max_seqs is not None and self.seqs + seqs > self.max_seqs:
            raise Overloaded("max_num_queued_reqs")
        if self.max_prefill is not None and self.prefill_tokens >= self.max_prefill:
            raise Overloaded("max_num_queued_tokens")
        self.seqs += seqs
        self.prefill_tokens += prompt_tokens

    def prefilled(self, prompt_tokens: int) -> None:
        self.prefill_tokens -= prompt_tokens

    def leave(self, seqs: int) -> None:
        self.seqs -= seqs

    def clear(self) -> None:
        self.seqs = self.prefill_tokens = 0
