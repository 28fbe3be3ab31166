"""Anthropic's context editing (a Messages request's `context_management`), applied to the conversation
before it is rendered, as Anthropic applies it on its side: the client keeps its whole history, and the
model sees the edited one. Each edit is measured by rendering the prompt again."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec

from kiln.api.errors import APIError
from kiln.api.messages_protocol import (
    AllThinkingTurns,
    ClearedThinking,
    ClearedToolUses,
    ClearThinking,
    ClearToolUses,
    CountTokensRequest,
    InputTokens,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)

Body = TypeVar("Body", MessagesRequest, CountTokensRequest)
Applied = ClearedToolUses | ClearedThinking
# What a cleared tool result says in its place, so the model knows it was there.
CLEARED = "[tool result cleared]"


async def apply_edits(
    body: Body, count: Callable[[Body], Awaitable[int]]
) -> tuple[Body, list[Applied], int | None, int | None]:
    """The body with its edits applied, what each cleared, and the prompt's tokens before and after them.
    count: a body's prompt tokens, as rendered, called only where an edit needs it (Claude Code sends
    clear_thinking keep "all", which needs none): both are None where nothing counted them, and then
    nothing was cleared."""
    tokens: int | None = None  # the body's as it stands, once counted
    before: int | None = None
    applied: list[Applied] = []
    assert body.context_management is not None
    for edit in body.context_management.edits:
        if isinstance(edit, ClearThinking):
            thinking = body.thinking
            if thinking is None or thinking.type not in ("enabled", "adaptive"):
                message = "`clear_thinking_20251015` strategy requires `thinking` to be enabled or adaptive"
                raise APIError(400, message, "context_management")
            edited, turns = _clear_thinking(body, edit)
        else:
            if tokens is None and isinstance(edit.trigger, InputTokens):
                tokens = await count(body)
            edited, turns = _clear_tool_uses(body, edit, tokens)
        if not turns:
            continue
        if tokens is None:
            tokens = await count(body)
        if before is None:  # nothing cleared yet: the body's count is the original's
            before = tokens
        after = await count(edited)
        if isinstance(edit, ClearThinking):
            applied.append(ClearedThinking(turns, tokens - after))
        elif edit.clear_at_least is not None and tokens - after < edit.clear_at_least.value:
            continue  # too little to be worth changing the prompt's prefix (and so missing the cache)
        else:
            applied.append(ClearedToolUses(turns, tokens - after))
        body, tokens = edited, after
    return body, applied, tokens if before is None else before, tokens


def _clear_thinking(body: Body, edit: ClearThinking) -> tuple[Body, int]:
    """The thinking of every assistant turn before the last `keep`; how many turns had some."""
    if edit.keep == "all" or isinstance(edit.keep, AllThinkingTurns):
        return body, 0
    turns = [i for i, m in enumerate(body.messages) if m.role == "assistant"]
    cleared = 0
    messages = list(body.messages)
    for i in turns[: max(0, len(turns) - edit.keep.value)]:
        m = messages[i]
        if isinstance(m.content, str):
            continue
        kept = [b for b in m.content if not isinstance(b, ThinkingBlock | RedactedThinkingBlock)]
        if len(kept) < len(m.content):
            messages[i] = msgspec.structs.replace(m, content=kept)
            cleared += 1
    return msgspec.structs.replace(body, messages=messages), cleared


def _clear_tool_uses(body: Body, edit: ClearToolUses, tokens: int | None) -> tuple[Body, int]:
    """Once triggered, each tool use but the last `keep` (and those of `exclude_tools`): its result as
    CLEARED, and its input emptied where `clear_tool_inputs` says; how many uses were cleared."""
    uses = [
        b
        for m in body.messages
        if not isinstance(m.content, str)
        for b in m.content
        if isinstance(b, ToolUseBlock)
    ]
    over = (tokens or 0) if isinstance(edit.trigger, InputTokens) else len(uses)
    if over <= edit.trigger.value:
        return body, 0
    spared = set(edit.exclude_tools or ())
    clearable = [u for u in uses if u.name not in spared]
    ids = {u.id for u in clearable[: max(0, len(clearable) - edit.keep.value)]}
    if not ids:
        return body, 0
    inputs = edit.clear_tool_inputs
    messages = [_cleared(m, ids, inputs) for m in body.messages]
    return msgspec.structs.replace(body, messages=messages), len(ids)


def _cleared(m: Message, ids: set[str], inputs: bool | list[str] | None) -> Message:
    if isinstance(m.content, str):
        return m
    blocks = []
    for b in m.content:
        if isinstance(b, ToolResultBlock) and b.tool_use_id in ids:
            b = msgspec.structs.replace(b, content=CLEARED)
        elif isinstance(b, ToolUseBlock) and b.id in ids and (inputs is True or b.name in (inputs or ())):
            b = msgspec.structs.replace(b, input={})
        blocks.append(b)
    return msgspec.structs.replace(m, content=blocks)
