"""vLLM's offline outputs of a pooling model: what LLM.embed, LLM.score and LLM.classify give, one per
prompt (or pair)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

Out = TypeVar("Out")


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]


@dataclass(slots=True)
class PoolingRequestOutput(Generic[Out]):
    request_id: str
    prompt_token_ids: list[int]  # a score's: the pair's, one after the other
    finished: bool
    outputs: Out


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
