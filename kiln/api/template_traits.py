"""What the Messages API needs to know of the model's chat template, found by rendering probes as vLLM
finds it (once, at the first /v1/messages request): whether system messages must all come first, and how
to turn thinking off."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, get_args

from kiln.api.chat_render import render_prompt
from kiln.api.errors import APIError
from kiln.api.messages_protocol import Effort
from kiln.api.protocol import ChatCompletionRequest, ChatMessage
from kiln.engine.prompt_embeds import SplicedEmbeds
from kiln.server_config import ServerConfig

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class TemplateTraits:
    # Inline system messages (Claude Code's reminders) merged into the leading one, for templates that
    # refuse a system message after the first turn (Qwen's).
    system_first: bool
    disabled_effort: str  # the reasoning_effort of thinking {"type": "disabled"}


def template_traits(tokenizer: Any, server: ServerConfig) -> TemplateTraits:
    # Both with and without tools: a template may branch on them.
    system_first = any(_refuses_inline_system(tokenizer, server, tools) for tools in (None, []))
    if system_first:
        log.warning(
            "the chat template wants system messages first, so /v1/messages merges inline system messages "
            "into the leading one; each new one changes the prompt's prefix, which then misses the prefix "
            "cache (a --chat-template that takes them inline avoids this)"
        )
    effort = server.anthropic_disabled_thinking_effort
    if effort == "auto":
        effort = _disabled_effort(tokenizer, server)
        log.debug("/v1/messages: thinking disabled is reasoning_effort %r", effort)
    return TemplateTraits(system_first, effort)


def _disabled_effort(tokenizer: Any, server: ServerConfig) -> str:
    """vLLM's "auto": "none" where the template renders it apart from every thinking effort, else "low"
    (a model that always thinks, or refuses "none")."""
    hi = [ChatMessage(role="user", content="Hi")]
    none = _render(tokenizer, server, hi, None, reasoning_effort="none")
    if none is None or any(
        _render(tokenizer, server, hi, None, reasoning_effort=e) == none for e in get_args(Effort)
    ):
        return "low"
    return "none"


def _refuses_inline_system(tokenizer: Any, server: ServerConfig, tools: list | None) -> bool:
    messages = [ChatMessage(role=role, content="t") for role in ("system", "user", "system", "user")]
    return _render(tokenizer, server, messages, tools, add_generation_prompt=False) is None


def _render(
    tokenizer: Any, server: ServerConfig, messages: list[ChatMessage], tools: list | None, **fields: Any
) -> list[int] | SplicedEmbeds | None:
    """The probe's prompt, as a chat request with these fields renders it; None where the template refuses."""
    body = ChatCompletionRequest(
        messages=messages, chat_template_kwargs=server.default_chat_template_kwargs, **fields
    )
    try:
        return render_prompt(tokenizer, messages, body, tools, server.chat_template_content_format)
    except APIError:
        return None
