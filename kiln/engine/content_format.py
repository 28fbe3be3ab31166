"""How a chat template reads a message's content, as vLLM detects it (--chat-template-content-format auto):
"openai" where the template loops over the content's parts, so it gets the list of parts; else "string",
the text parts joined by newlines."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any, Literal

from jinja2 import nodes
from transformers.utils.chat_template_utils import _compile_jinja_template

log = logging.getLogger(__name__)

ContentFormat = Literal["string", "openai"]


def resolve_content_format(given: str, template: Any) -> ContentFormat:
    """--chat-template-content-format for this template: auto detects it (a template that is not one
    string, or none, reads strings)."""
    if given in ("string", "openai"):
        return given  # type: ignore[return-value]
    if given != "auto":
        raise ValueError(f"chat_template_content_format must be auto, string or openai, not {given!r}")
    return detect_content_format(template) if isinstance(template, str) else "string"


def text_parts(content: str | list[dict[str, Any]] | None) -> list[str]:
    """An offline message's content as its text parts (ValueError for any other kind of part)."""
    if content is None or isinstance(content, str):
        return [] if content is None else [content]
    if any(part.get("type") != "text" for part in content):
        raise ValueError("only text content parts are supported")
    return [part.get("text") or "" for part in content]


def template_content(texts: list[str], fmt: ContentFormat) -> str | list[dict[str, str]]:
    """A message's text parts as the template reads them: joined by newlines, or as OpenAI's parts."""
    return "\n".join(texts) if fmt == "string" else [{"type": "text", "text": t} for t in texts]


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    try:  # transformers' environment: its templates' own tags ({% generation %}) parse
        root = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # a template that does not compile: rendering it will say why
        return "string"
    found: ContentFormat = "openai" if next(_content_loops(root), None) is not None else "string"
    log.info("the chat template reads message content as %r (--chat-template-content-format auto)", found)
    return found


def _access(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """`name`, or with a key `name.key` / `name['key']`, through filters, tests and slices."""
    if isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None and _access(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _access(node.node, name, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, nodes.Getitem):
        return _access(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and _access(node.node, name) and node.attr == key


def _aliases(root: nodes.Template, name: str) -> list[str]:
    """`name` and every variable assigned from it (or a slice or filter of it), transitively."""
    found, queue = [name], [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(nodes.Assign):
            if _access(assign.node, current) and isinstance(assign.target, nodes.Name):
                found.append(assign.target.name)
                if assign.target.name != current:
                    queue.append(assign.target.name)
    return found


def _content_loops(root: nodes.Template) -> Iterator[nodes.For]:
    """Loops over a message's content: `for part in message['content']` where message runs over the
    messages, a macro's loop over a parameter that a call passes message content, or a loop over a
    variable named `content` outside macros."""
    messages = _aliases(root, "messages")
    per_message = [
        loop.target.name
        for loop in root.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and any(_access(loop.iter, m) for m in messages)
    ]

    def content(node: nodes.Node) -> bool:
        return any(_access(node, m, "content") for m in per_message)

    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}
    for macro in root.find_all(nodes.Macro):
        names = [a.name for a in macro.args]
        bound: set[str] = set()
        for call in root.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                bound |= {names[i] for i, arg in enumerate(call.args[: len(names)]) if content(arg)}
                bound |= {k.key for k in call.kwargs if k.key in names and content(k.value)}
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if bound:
                macro_params[id(loop)] = bound
    for loop in root.find_all(nodes.For):
        it = loop.iter
        named = isinstance(it, nodes.Name) and (
            it.name in macro_params.get(id(loop), ()) or (id(loop) not in in_macros and it.name == "content")
        )
        if named or content(it):
            yield loop
