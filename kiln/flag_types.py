"""The values of `kiln serve`'s flags as vLLM parses them: sizes with suffixes, LoRA modules."""

from __future__ import annotations

import argparse
import json


def human_readable_int(text: str) -> int:
    """vLLM's sizes: 25.6k (x1000), 4G (x2**30; no decimals), or a plain integer."""
    number, unit = text[:-1], text[-1:]
    decimal, binary = "kmgt", "KMGT"
    if unit in binary and "." in number:
        raise argparse.ArgumentTypeError(
            f"Decimals are not allowed with binary suffixes like {unit}. Did you mean to use "
            f"{number}{unit.lower()} instead?"
        )
    try:
        if unit in decimal:
            return int(float(number) * 1000 ** (decimal.index(unit) + 1))
        if unit in binary:
            return int(number) * 1024 ** (binary.index(unit) + 1)
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: an integer, with k, m, g or t (x1000) or K, M, G or T (x1024) after it"
        ) from None


def lora_module(text: str) -> dict:
    """vLLM's --lora-modules entries: name=path, or JSON with name, path and base_model_name."""
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not name=path or a JSON object")
    return {"name": name, "path": path}


def gib(text: str) -> float:
    """--kv-cache-memory-bytes as kiln's cache.kv_cache_gib."""
    return human_readable_int(text) / 2**30
