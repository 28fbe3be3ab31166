"""Chat messages through the model's chat template, as vLLM gives them."""

from __future__ import annotations

import inspect
from typing import Any, Literal

import msgspec

from kiln.api.errors import APIError
from kiln.api.protocol import ChatMessage, ChatRender, Tool
from kiln.engine.chat_template import render_chat
from kiln.engine.content_format import resolve_content_format, template_content


def render_messages(
    tokenizer: Any,
    messages: list[ChatMessage],
    body: ChatRender,
    tools: list[Tool] | None = None,
    content_format: Literal["auto", "string", "openai"] = "auto",
) -> list[int]:
    """The request's messages through the model's chat template, each content as vLLM gives it: its text
    parts joined by newlines ("string"), or a list of text parts ("openai", for a template that loops over
    them); "auto" detects which the template reads. The template's variables may come from the request,
    but never the call's own arguments, nor the template itself unless the server trusts it
    (Inputs.chat_ids): a template could run unbounded loops."""
    chat_template_kwargs = body.chat_template_kwargs
    reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters)
    for key in chat_template_kwargs or {}:
        if key in reserved:
            raise APIError(400, f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
    fmt = resolve_content_format(content_format, body.chat_template or tokenizer.chat_template)
    plain = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if part.type != "text":
                    raise APIError(
                        400, f"{where}: only text content parts are supported, not {part.type!r}", "messages"
                    )
                if part.text is None:
                    raise APIError(400, f"{where}: a text part needs its `text`", "messages")
            texts = [part.text or "" for part in content]
        else:
            texts = [] if content is None else [content]
        message: dict[str, Any] = {"role": m.role, "content": template_content(texts, fmt)}
        if m.name is not None:
            message["name"] = m.name
        thought = m.reasoning if m.reasoning is not None else m.reasoning_content
        if thought is not None:  # both names, as vLLM gives templates
            message["reasoning"] = message["reasoning_content"] = thought
        if m.tool_calls:
            message["tool_calls"] = msgspec.to_builtins(m.tool_calls)
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        plain.append(message)
    defs = None if tools is None else msgspec.to_builtins(tools)
    effort = body.reasoning_effort
    if effort is not None:  # as vLLM: the template's variable, and thinking on unless the request says
        chat_template_kwargs = {"enable_thinking": effort != "none", **(chat_template_kwargs or {})}
        chat_template_kwargs["reasoning_effort"] = effort
    try:
        return render_chat(
            tokenizer,
            plain,
            body.add_generation_prompt,
            chat_template_kwargs,
            defs,
            continue_final_message=body.continue_final_message,
            add_special_tokens=body.add_special_tokens,
            documents=body.documents,
            chat_template=body.chat_template,
        )
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None


def content_chars(message: ChatMessage) -> int:
    content = message.content
    if isinstance(content, list):
        return sum(len(part.text or "") for part in content)
    return len(content or "")
