from __future__ import annotations

import msgspec


class PoolingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's, for an embedding: each field left unset takes the server's pooler config."""

    dimensions: int | None = None  # the embedding's first `dimensions` values (Matryoshka models only)
    use_activation: bool | None = None  # an embedding's activation: scaled to unit length
