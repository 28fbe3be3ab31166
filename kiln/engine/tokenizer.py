"""The model's tokenizer, as transformers loads it, and the token ids that end a sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, GenerationConfig

from kiln.config import EngineConfig


def load_tokenizer(config: EngineConfig, model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(config.model.tokenizer or model_path, local_files_only=True)


def eos_token_ids(tokenizer: Any, model_path: Path) -> set[int]:
    """The tokenizer's end-of-sequence id, and generation_config.json's (one id or a list), where given."""
    ids = {tokenizer.eos_token_id} - {None}
    if (model_path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
    return ids
