"""The server's defaults for request fields, laid on each body as it is parsed, so that handlers read the
body alone: vLLM's --return-tokens-as-token-ids, --enable-force-include-usage (usage in every stream) and
--default-chat-template-kwargs (under the request's own)."""

from __future__ import annotations

from typing import Any

import msgspec

from kiln.api.protocol import (
    ChatCompletionRequest,
    StreamOptions,
    TokenizeRequest,
    _PooledInputRequest,
    _SamplingRequest,
)
from kiln.server_config import ServerConfig


def with_defaults(body: Any, server: ServerConfig) -> Any:
    changes: dict[str, Any] = {}
    if isinstance(body, _SamplingRequest):
        if server.return_tokens_as_token_ids:
            changes["return_tokens_as_token_ids"] = True
        if server.enable_force_include_usage and body.stream:
            changes["stream_options"] = msgspec.structs.replace(
                body.stream_options or StreamOptions(), include_usage=True
            )
    kwargs = server.default_chat_template_kwargs
    if kwargs and isinstance(body, ChatCompletionRequest | TokenizeRequest | _PooledInputRequest):
        changes["chat_template_kwargs"] = {**kwargs, **(body.chat_template_kwargs or {})}
    return msgspec.structs.replace(body, **changes) if changes else body
