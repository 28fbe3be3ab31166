"""Messages to prompt text through the model's chat template: one path for LLM.chat and the API (their
callers tokenize it, and splice prompt embeddings into it)."""

from __future__ import annotations

from typing import Any


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    *,
    continue_final_message: bool = False,
    documents: list[dict[str, str]] | None = None,
    chat_template: str | None = None,
) -> str:
    """Raises ValueError for empty messages, a model without a template, or messages it refuses. tools:
    OpenAI's tool definitions, for a template that shows them to the model; continue_final_message: the last
    message left open, for the model to go on with it; documents: for a template that shows them (RAG);
    chat_template: a Jinja template in place of the tokenizer's."""
    if not messages:
        raise ValueError("messages must not be empty")
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use /v1/completions")
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            **(chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja raises for conversations the template refuses
        raise ValueError(f"the chat template rejected these messages: {e}") from None
