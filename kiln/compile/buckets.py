"""The shapes kiln compiles for: decode batch sizes and token counts. A step is padded up to its bucket."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kiln.config import EngineConfig


@dataclass(frozen=True, slots=True)
class Bucket:
    kind: str  # "decode": every row is one sequence's next token; "tokens": any mix of prefill and decode
    size: int

    def __str__(self) -> str:
        return f"{self.kind}-{self.size}"


@dataclass(frozen=True, slots=True)
class BucketPlan:
    decode_sizes: tuple[int, ...]
    token_sizes: tuple[int, ...]

    @classmethod
    def from_config(cls, config: EngineConfig) -> BucketPlan:
        max_tokens = config.scheduler.max_num_batched_tokens
        # A decode step holds at most max_num_seqs sequences and, at a token each, max_num_batched_tokens:
        # the step buffers hold that many rows, and a larger bucket's warmup (a CUDA graph's capture) would
        # overrun them.
        max_decode = min(config.scheduler.max_num_seqs, max_tokens)
        c = config.compile
        if c.decode_sizes and c.max_decode_size is not None and c.max_decode_size != max(c.decode_sizes):
            raise ValueError(
                f"compile.max_decode_size ({c.max_decode_size}) should be the largest of "
                f"compile.decode_sizes ({max(c.decode_sizes)})"
            )
        decode = c.decode_sizes or default_decode_sizes(min(max_decode, c.max_decode_size or MAX_GRAPH_BATCH))
        tokens = config.compile.token_sizes or default_token_sizes(max_tokens)
        for key, sizes, limit, what in (
            ("decode_sizes", decode, max_decode, "min(max_num_seqs, max_num_batched_tokens)"),
            ("token_sizes", tokens, max_tokens, "max_num_batched_tokens"),
        ):
            if over := sorted(s for s in set(sizes) if s > limit):
                raise ValueError(f"compile.{key} {over} exceed {what}, {limit}: no step is that large")
        return cls(tuple(sorted(set(decode))), tuple(sorted(set(tokens))))

    def bucket(self, num_tokens: int, decode_only: bool) -> Bucket | None:
        """The smallest bucket holding the step, or None when it is larger than every bucket."""
        sizes = self.decode_sizes if decode_only else self.token_sizes
        i = bisect.bisect_left(sizes, num_tokens)
        if i == len(sizes):
            return None
        return Bucket("decode" if decode_only else "tokens", sizes[i])

    def all(self) -> list[Bucket]:
        """Largest first, the order CUDA graphs are captured in (smaller ones reuse the pool)."""
        decode = [Bucket("decode", s) for s in reversed(self.decode_sizes)]
        return decode + [Bucket("tokens", s) for s in reversed(self.token_sizes)]


# vLLM's largest CUDA graph by default: a larger decode's launches are short beside its GPU time.
MAX_GRAPH_BATCH = 512


def default_decode_sizes(top: int) -> list[int]:
    """vLLM's CUDA-graph batch sizes: 1, 2, 4, steps of 8 to 256, then of 16, up to top."""
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, min(top, 256) + 1, 8))
    sizes += range(272, top + 1, 16)
    if not sizes or sizes[-1] != top:
        sizes.append(top)
    return sizes


def default_token_sizes(max_num_batched_tokens: int) -> list[int]:
    sizes = [16]
    while sizes[-1] < max_num_batched_tokens:
        sizes.append(sizes[-1] * 2)
    sizes[-1] = max_num_batched_tokens
    return sorted(set(sizes))
