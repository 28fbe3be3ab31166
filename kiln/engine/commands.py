"""What the event loop asks of the engine thread, through AsyncEngine's command queue (pausing and
resuming are kiln.engine.pause's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiln.engine.bad_words import BadWords
from kiln.engine.prompt_embeds import GivenPrompt
from kiln.lora_request import LoRARequest
from kiln.models.lora_adapter import Adapter
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams


@dataclass(slots=True)
class Add:
    request_id: str
    prompt: list[int] | GivenPrompt
    params: SamplingParams | PoolingParams
    priority: int
    cache_salt: str | None
    bad_words: BadWords  # the params' bad words, tokenized when they were checked on the event loop
    lora: LoRARequest | None


@dataclass(slots=True)
class Lora:
    """Hand a checked adapter to the engine (adapter), or let it forget one (lora_int_id)."""

    adapter: Adapter | None
    lora_int_id: int = 0


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class ResetPrefixCache:
    reset_running_requests: bool
    done: Callable[[bool], None]
