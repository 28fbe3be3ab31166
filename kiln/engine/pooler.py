"""Embeddings from the final hidden states (vLLM's pooling runner): which rows a sequence's embedding is
made of (its last token, the mean of its tokens, or its first), and whether it is scaled to unit length.
A sentence-transformers folder says both in its modules.json, as vLLM reads it."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from kiln.config import ModelConfig, PoolerConfig
from kiln.pooling_params import PoolingParams

log = logging.getLogger(__name__)

Kind = Literal["LAST", "MEAN", "CLS"]
# sentence-transformers' module types, by their older and newer paths (as vLLM knows them).
_ST_POOLING = {
    "sentence_transformers.models.Pooling",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
}
_ST_NORMALIZE = {
    "sentence_transformers.models.Normalize",
    "sentence_transformers.base.modules.normalize.Normalize",
    "sentence_transformers.sentence_transformer.modules.normalize.Normalize",
}
_ST_TRANSFORMER = {
    "sentence_transformers.models.Transformer",
    "sentence_transformers.sentence_transformer.modules.transformer.Transformer",
}


@dataclass(frozen=True, slots=True)
class Pooler:
    """The served model's pooling (model.runner pooling) and its defaults for a request's params."""

    kind: Kind
    normalize: bool  # embed: to unit length; classify: the probabilities (softmax, or sigmoid of one class)
    dimensions: int | None  # the server's default (model.pooler_config)
    hidden_size: int
    matryoshka: bool  # config.json's is_matryoshka or matryoshka_dimensions: a prefix is an embedding too
    matryoshka_dimensions: tuple[int, ...] | None
    head: torch.Tensor | None = None  # a classifier's score weight (classes x hidden): task classify
    labels: tuple[str, ...] = ()  # config.json's id2label, by class

    @property
    def task(self) -> Literal["embed", "classify"]:
        return "embed" if self.head is None else "classify"

    def sequence(self, params: PoolingParams) -> Pooling:
        """One request's pooling; ValueError, naming the field, for params this model cannot serve."""
        dims = self.dimensions if params.dimensions is None else params.dimensions
        if dims is not None and self.head is not None:
            raise ValueError("dimensions must be unset: the model classifies")
        if dims is not None:
            if not self.matryoshka:
                raise ValueError(
                    "dimensions must be unset: the model does not support Matryoshka embeddings "
                    f"(received dimensions={dims})"
                )
            if not 1 <= dims <= self.hidden_size:
                raise ValueError(f"dimensions must be in [1, {self.hidden_size}], got {dims}")
            mds = self.matryoshka_dimensions
            if mds is not None and dims not in mds:
                raise ValueError(f"dimensions must be one of the model's Matryoshka dimensions {list(mds)}")
        normalize = self.normalize if params.use_activation is None else params.use_activation
        return Pooling(self.kind, normalize, dims, self.head)


@dataclass(slots=True, eq=False)
class Pooling:
    """One sequence's embedding, gathered over its prompt's chunks."""

    kind: Kind
    normalize: bool
    dimensions: int | None
    head: torch.Tensor | None = None  # a classifier's score weight
    acc: torch.Tensor | None = None  # MEAN: the sum of its rows so far; CLS: its first row

    @property
    def reads_cache(self) -> bool:
        """Only the last row is computed for a prompt served from the prefix cache, which is all LAST
        needs."""
        return self.kind == "LAST"

    def take(self, rows: torch.Tensor, start: int, total: int) -> torch.Tensor | None:
        """This step's rows of the prompt, the first at position `start` of `total`; the embedding once
        the last row is in (float32, as vLLM's pooler head)."""
        if self.kind == "MEAN":
            part = rows.sum(0, dtype=torch.float32)
            self.acc = part if start == 0 or self.acc is None else self.acc + part
        elif self.kind == "CLS" and start == 0:
            self.acc = rows[0].to(torch.float32, copy=True)  # kept past this step's hidden states
        if start + len(rows) < total:
            return None
        assert self.kind == "LAST" or self.acc is not None
        v = rows[-1].float() if self.kind == "LAST" else self.acc / (total if self.kind == "MEAN" else 1)
        if self.head is not None:  # a classifier's logits, as probabilities unless use_activation is false
            logits = self.head.float() @ v
            if not self.normalize:
                return logits
            return torch.sigmoid(logits) if len(logits) == 1 else torch.softmax(logits, -1)
        if self.dimensions is not None:
            v = v[: self.dimensions]
        return F.normalize(v, dim=-1) if self.normalize else v


def check_pairs(num_firsts: int, num_seconds: int) -> None:
    """vLLM's pairings for scores: 1:1, 1:N or N:N."""
    if num_firsts > 1 and num_firsts != num_seconds:
        raise ValueError("Input lengths must be either 1:1, 1:N or N:N")


def pair_scores(firsts: list[torch.Tensor], seconds: list[torch.Tensor]) -> list[float]:
    """The cosine similarity of each pair of embeddings (paired as check_pairs allows), as vLLM scores
    with an embedding model."""
    a = torch.stack(firsts).expand(len(seconds), -1)
    return F.cosine_similarity(a, torch.stack(seconds), dim=-1).tolist()


def resolve_pooler(
    model: ModelConfig, path: Path, hidden_size: int, headless: bool, head: torch.Tensor | None = None
) -> Pooler | None:
    """The model's pooler when it is served for embeddings (runner pooling; or auto with a
    sentence-transformers pooling module, or a backbone saved without its head) or classes (head: a
    sequence classifier's score weight), else None: it generates. model.pooler_config wins over the
    folder's settings."""
    given = model.pooler_config or PoolerConfig()
    config = json.loads((path / "config.json").read_text()) | (model.hf_overrides or {})
    if head is not None:
        if model.runner == "generate":
            raise ValueError(f"{path} holds a sequence classifier: it serves /classify (--runner pooling)")
        id2label = {int(k): v for k, v in (config.get("id2label") or {}).items()}
        labels = tuple(id2label.get(i, f"LABEL_{i}") for i in range(len(head)))
        kind: Kind = given.pooling_type or "LAST"
        log.info("pooling runner: a classifier of %d classes over %s pooling", len(head), kind)
        return Pooler(kind, given.use_activation is not False, None, hidden_size, False, None, head, labels)
    if model.convert == "embed" and model.runner == "generate":
        raise ValueError("--convert embed makes an embedding model, which needs --runner pooling (or auto)")
    if model.runner == "generate" and headless:
        raise ValueError(f"{path} holds a model without its LM head: it serves embeddings (--runner pooling)")
    st = _sentence_transformers(path)
    pooled = model.runner == "pooling" or model.convert == "embed" or st is not None or headless
    if model.runner == "generate" or not pooled:
        return None
    st = st or {}
    kind = given.pooling_type or st.get("kind") or "LAST"
    normalize = st.get("normalize", True) if given.use_activation is None else given.use_activation
    mds = config.get("matryoshka_dimensions")
    matryoshka = bool(mds) or bool(config.get("is_matryoshka"))
    pooler = Pooler(kind, normalize, given.dimensions, hidden_size, matryoshka, tuple(mds) if mds else None)
    if pooler.dimensions is not None:
        pooler.sequence(PoolingParams())  # the server's default dimensions, checked once
    log.info("pooling runner: %s pooling, %snormalized", kind, "" if normalize else "not ")
    return pooler


def _sentence_transformers(path: Path) -> dict[str, Any] | None:
    """What a sentence-transformers modules.json says of pooling and normalizing (None: no Pooling
    module)."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    pooling = next((m for m in modules if m.get("type") in _ST_POOLING), None)
    if pooling is None:
        return None
    for t in types:
        if t not in _ST_POOLING | _ST_NORMALIZE | _ST_TRANSFORMER:
            raise ValueError(f"{modules_file}: module {t} is not supported (kiln pools and normalizes only)")
    out: dict[str, Any] = {"normalize": any(t in _ST_NORMALIZE for t in types)}
    pooling_file = path / pooling.get("path", "") / "config.json"
    settings = json.loads(pooling_file.read_text()) if pooling_file.is_file() else {}
    names = [settings["pooling_mode"]] if isinstance(settings.get("pooling_mode"), str) else []
    names += [k for k, v in settings.items() if k.startswith("pooling_mode_") and v is True]
    if names:
        name = names[0].removeprefix("pooling_mode_").split("_", 1)[0]
        kind = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}.get(name)
        if kind is None:
            raise ValueError(
                f"{pooling_file}: pooling mode {names[0]!r} is not supported (lasttoken, mean, cls)"
            )
        out["kind"] = kind
    return out
