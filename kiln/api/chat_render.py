"""Chat messages through the model's chat template, as vLLM gives them."""

from __future__ import annotations

import inspect
from typing import Any, Literal

import msgspec

from kiln.api.errors import APIError
from kiln.api.protocol import ChatMessage, ChatRender, TextPart, Tool
from kiln.engine.chat_template import render_chat
from kiln.engine.content_format import resolve_content_format, template_content
from kiln.engine.prompt_embeds import PLACEHOLDER, PromptEmbeds, SplicedEmbeds

# vLLM's words
_MISSING_DATA = (
    "prompt_embeds content part requires a non-empty `data` field with base64-encoded tensor bytes."
)
_RESERVED = (
    "Text content may not contain the reserved placeholder {token!r}. This placeholder is used internally to "
    "mark `prompt_embeds` splice positions in the tokenized prompt."
)


def render_prompt(
    tokenizer: Any,
    messages: list[ChatMessage],
    body: ChatRender,
    tools: list[Tool] | None = None,
    content_format: Literal["auto", "string", "openai"] = "auto",
    embeds_width: int | None = None,
) -> list[int] | SplicedEmbeds:
    """The request's messages through the model's chat template, each content as vLLM gives it: its text
    parts joined by newlines ("string"), or a list of text parts ("openai", for a template that loops over
    them); "auto" detects which the template reads. The template's variables may come from the request,
    but never the call's own arguments, nor the template itself unless the server trusts it
    (Inputs.chat_ids): a template could run unbounded loops. Where the server takes prompt embeddings
    (embeds_width: the model's hidden size), a {"type": "prompt_embeds", "data": ...} part's rows are
    spliced in where the template put it: a SplicedEmbeds."""
    chat_template_kwargs = body.chat_template_kwargs
    reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters)
    for key in chat_template_kwargs or {}:
        if key in reserved:
            raise APIError(400, f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
    fmt = resolve_content_format(content_format, body.chat_template or tokenizer.chat_template)
    plain: list[dict[str, Any]] = []
    given: list[PromptEmbeds] = []  # the parts given as embeddings, in order
    texts_all: list[str] = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = [
                _part_text(part, f"messages[{i}].content[{j}]", embeds_width, given)
                for j, part in enumerate(content)
            ]
        else:
            texts = [] if content is None else [content]
        texts_all += texts
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
    args = (tokenizer, plain, body.add_generation_prompt, chat_template_kwargs, defs)
    options = {
        "continue_final_message": body.continue_final_message,
        "documents": body.documents,
        "chat_template": body.chat_template,
    }
    special = bool(body.add_special_tokens)  # (unset, as /tokenize's messages may leave it: False, as vLLM)
    try:
        text = render_chat(*args, **options)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    if not given:
        return tokenizer.encode(text, add_special_tokens=special)
    if sum(t.count(PLACEHOLDER) for t in texts_all) > len(given):  # a text could move the rows
        raise APIError(400, _RESERVED.format(token=PLACEHOLDER), "messages")
    return _splice(tokenizer, text, given, special)


def _part_text(part: TextPart, where: str, embeds_width: int | None, given: list[PromptEmbeds]) -> str:
    """A content part as the template sees it: its text, or for a part given as embeddings (appended to
    `given`) the placeholder where its rows go."""
    if part.type == "prompt_embeds":
        if embeds_width is None:
            raise APIError(400, "You must set `--enable-prompt-embeds` to input `prompt_embeds`", "messages")
        if not part.data:
            raise APIError(400, _MISSING_DATA, "messages")
        if part.text is not None:
            raise APIError(400, f"{where}: a prompt_embeds part takes no `text`", "messages")
        try:
            embeds = PromptEmbeds.decode(part.data)
            embeds.check(embeds_width)
        except ValueError as e:
            raise APIError(400, f"{where}: {e}", "messages") from None
        given.append(embeds)
        return PLACEHOLDER
    if part.type != "text":
        kinds = "text and prompt_embeds" if embeds_width is not None else "text"
        raise APIError(
            400, f"{where}: only {kinds} content parts are supported, not {part.type!r}", "messages"
        )
    if part.text is None:
        raise APIError(400, f"{where}: a text part needs its `text`", "messages")
    if part.data is not None:
        raise APIError(400, f"{where}: a text part takes no `data`", "messages")
    return part.text


def _splice(tokenizer: Any, text: str, given: list[PromptEmbeds], add_special_tokens: bool) -> SplicedEmbeds:
    """The rendered text's ids with each part's rows where its placeholder stands. The text between them is
    tokenized piece by piece, as vLLM's tokenizer does around the special token it registers for it."""
    pieces = text.split(PLACEHOLDER)
    if len(pieces) != len(given) + 1:
        raise APIError(
            400,
            f"the chat template showed {len(pieces) - 1} placeholders for {len(given)} prompt_embeds parts: "
            "each part must appear once (does the template drop a message?)",
            "messages",
        )
    ids = tokenizer.encode(pieces[0], add_special_tokens=add_special_tokens)
    parts = []
    for embeds, piece in zip(given, pieces[1:], strict=True):
        parts.append((len(ids), embeds))
        ids += embeds.ids
        ids += tokenizer.encode(piece, add_special_tokens=False)
    return SplicedEmbeds(ids, tuple(parts))


def content_chars(message: ChatMessage) -> int:
    content = message.content
    if isinstance(content, list):
        return sum(len(part.text or "") for part in content)
    return len(content or "")
