"""The model's tokenizer, as transformers loads it, the token ids that end a sequence, and the sampling
defaults the model's generation config recommends."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, GenerationConfig

from kiln.config import EngineConfig

log = logging.getLogger(__name__)


# What a request that needs text is told where the server runs without a tokenizer (vLLM's words).
NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"


def load_tokenizer(config: EngineConfig, model_path: Path) -> Any:
    """None with model.skip_tokenizer_init."""
    if config.model.skip_tokenizer_init:
        return None
    tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer or model_path, local_files_only=True)
    if config.model.chat_template is not None:
        tokenizer.chat_template = chat_template(config.model.chat_template)
    return tokenizer


def chat_template(given: str) -> str:
    """vLLM's --chat-template: a file's contents, or the template itself where it holds Jinja's marks."""
    path = Path(given).expanduser()
    if path.is_file():
        return path.read_text()
    if any(mark in given for mark in ("{%", "{{", "\n")):
        return given
    raise ValueError(f"model.chat_template: {given!r} is neither a readable file nor a Jinja template")


# The generation config's fields that are sampling defaults (vLLM's list).
SAMPLING_FIELDS = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p", "min_p",
    "max_new_tokens",
)  # fmt: skip


# Values that change nothing (OpenAI's defaults): left out, so a model that sets only these has no defaults.
_NEUTRAL = {
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "temperature": 1.0,
    "top_p": 1.0, "top_k": 0, "min_p": 0.0,
}  # fmt: skip


def sampling_defaults(config: EngineConfig, model_path: Path) -> dict[str, Any]:
    """What a request that leaves a sampling field unset gets, as vLLM reads it: the generation config's
    sampling values (those transformers' to_diff_dict keeps), with override_generation_config laid over
    them; max_new_tokens becomes max_tokens."""
    source = config.model.generation_config
    folder = model_path if source == "auto" else Path(source)
    values: dict[str, Any] = {}
    if source != "vllm":
        if not (folder / "generation_config.json").is_file():
            if source != "auto":
                raise ValueError(f"model.generation_config: no generation_config.json in {folder}")
        else:
            values = GenerationConfig.from_pretrained(folder).to_diff_dict()
    values |= config.model.override_generation_config or {}
    defaults = {k: v for k in SAMPLING_FIELDS if (v := values.get(k)) is not None and v != _NEUTRAL.get(k)}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults:
        log.info(
            "requests that leave them unset get the model's recommended sampling (its generation config): "
            "%s; --generation-config vllm turns this off",
            defaults,
        )
    return defaults


def eos_token_ids(tokenizer: Any, model_path: Path) -> set[int]:
    """The tokenizer's end-of-sequence id (where there is a tokenizer), and generation_config.json's (one id
    or a list), where given."""
    ids = {getattr(tokenizer, "eos_token_id", None)} - {None}
    if (model_path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
    return ids
