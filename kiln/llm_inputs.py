"""The offline API's inputs: vLLM's prompt shapes, and the sampling params and adapters given per prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.engine.prompt_embeds import PromptEmbeds
from kiln.lora_request import LoRARequest
from kiln.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


def as_batch(prompts: Prompt | Sequence[Prompt]) -> list[tuple[str | list[int] | PromptEmbeds, str | None]]:
    """Each prompt as (its text, ids or embeddings; its cache salt)."""
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]  # type: ignore[list-item]
    return [_one(p) for p in prompts]


def _one(p: Prompt) -> tuple[str | list[int] | PromptEmbeds, str | None]:
    if not isinstance(p, dict):
        return p, None
    kinds = ("prompt", "prompt_token_ids", "prompt_embeds")
    unknown = set(p) - {*kinds, "cache_salt"}
    if unknown:
        raise ValueError(
            "prompt dicts take prompt, prompt_token_ids or prompt_embeds, and cache_salt, "
            f"not {sorted(unknown)}"
        )
    given = [k for k in kinds if k in p]
    if len(given) != 1:
        raise ValueError("a prompt dict needs exactly one of prompt, prompt_token_ids and prompt_embeds")
    if given[0] == "prompt_embeds":
        if not isinstance(p["prompt_embeds"], torch.Tensor):
            raise ValueError(f"prompt_embeds must be a torch.Tensor, not {type(p['prompt_embeds']).__name__}")
        return PromptEmbeds(p["prompt_embeds"]), p.get("cache_salt")
    return p[given[0]], p.get("cache_salt")


def params_for(
    batch: list[Any], params: SamplingParams | Sequence[SamplingParams] | None, defaults: dict[str, Any]
) -> list[SamplingParams]:
    """None: the model's recommended sampling (its generation config), as vLLM's LLM."""
    if params is None:
        return [SamplingParams(**defaults)] * len(batch)
    if isinstance(params, SamplingParams):
        return [params] * len(batch)
    if len(params) != len(batch):
        raise ValueError(f"got {len(params)} sampling params for {len(batch)} prompts")
    return list(params)


def per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if len(lora_request) != n:
        raise ValueError(
            f"The lengths of prompts ({n}) and lora_request ({len(lora_request)}) must be the same."
        )
    return list(lora_request)
