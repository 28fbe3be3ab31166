"""GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint): the tokenizer's configuration,
for a client that tokenizes or renders prompts itself."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from kiln.api.inputs import Inputs
from kiln.engine.async_engine import AsyncEngine


async def tokenizer_info(engine: AsyncEngine, inputs: Inputs, request: Request, body: None) -> dict[str, Any]:
    """As vLLM: the tokenizer's init kwargs less its vocabulary files, special tokens as their text, the
    tokenizer's class, and the chat template the server renders with (--chat-template's where given)."""
    tokenizer = inputs.tokenizer
    config = {k: v for k, v in tokenizer.init_kwargs.items() if k not in ("vocab_file", "merges_file")}
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    info |= {k: v for k, v in _plain(config).items() if k != "tokenizer_class"}
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info


def _plain(value: Any) -> Any:
    """JSON's types: an AddedToken as its text, keys as strings, anything else unknown (a path) as text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float)) else str(value)
