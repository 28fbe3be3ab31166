"""kiln: an LLM serving stack whose speed comes from the compiler."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.engine.beam_search import BeamSearchParams
    from kiln.engine.request_output import CompletionOutput, RequestOutput
    from kiln.llm import LLM
    from kiln.lora_request import LoRARequest
    from kiln.pooling_params import PoolingParams
    from kiln.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

# Imported on first use, so `kiln serve` starts its clock (and `kiln --help` answers) before torch loads.
_LAZY = {
    "LLM": "kiln.llm",
    "BeamSearchParams": "kiln.engine.beam_search",
    "CompletionOutput": "kiln.engine.output",
    "RequestOutput": "kiln.engine.output",
    "LoRARequest": "kiln.lora_request",
    "SamplingParams": "kiln.sampling_params",
    "PoolingParams": "kiln.pooling_params",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from kiln.version import VERSION

        return VERSION
    if name not in _LAZY:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
