"""A serve config from a YAML file with command-line overrides laid over it; errors name the file and
the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import yaml

from kiln.server_config import ServeConfig


class ConfigError(ValueError):
    pass


def load_serve_config(path: Path | None, overrides: dict[str, dict[str, Any]]) -> ServeConfig:
    """A YAML file (sections as in ServeConfig) with command-line overrides laid over it.
    Errors name the file and the offending key."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
        try:
            msgspec.convert(raw, ServeConfig)
        except msgspec.ValidationError as e:
            raise ConfigError(f"{path}: {validation_message(e)}") from None
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for section, values in overrides.items():
        merged.setdefault(section, {}).update(values)
    try:
        return msgspec.convert(merged, ServeConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"command-line option: {validation_message(e)}") from None


def validation_message(e: msgspec.ValidationError) -> str:
    # msgspec says "Object contains unknown field `x` - at `$.model`"; name the key as section.key.
    msg, _, where = str(e).partition(" - at ")
    key = where.strip("`").removeprefix("$").lstrip(".")
    if msg.startswith("Object contains unknown field"):
        field = msg.split("`")[1]
        key = f"{key}.{field}" if key else field
        return f"unknown key {key!r}"
    return f"key {key!r}: {msg}" if key else msg
