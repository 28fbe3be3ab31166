"""A chat reply, whole or streamed: how a choice's text becomes its message (a reasoning model's thinking
apart, then the calls the model chose, the rest content, or a forced call's JSON), its logprobs, and a
stream's chunks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from msgspec import UNSET, UnsetType

from kiln.api.protocol import ChatCompletionRequest, Tool
from kiln.api.reasoning import ThinkSplit
from kiln.api.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    Delta,
    DeltaToolCall,
    TokenLogprob,
    TopLogprob,
)
from kiln.api.serving import api_logprob, ids_if, token_text
from kiln.api.streaming import ChoiceDelta
from kiln.api.tool_calls import ToolCallStream
from kiln.api.tool_parser import Parser, parser_for
from kiln.engine.request import PositionLogprobs


def finish(reason: str | None, calls: bool) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def chat_logprobs(
    ids: list[int], positions: list[PositionLogprobs], k: int, as_ids: bool = False
) -> ChatLogprobs:
    content = []
    for token, entry in zip(ids, positions, strict=True):
        chosen = token_text(token, entry[token].decoded_token, as_ids)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda e: e[1].rank)[:k]
        named = [(token_text(t, lp.decoded_token, as_ids), api_logprob(lp.logprob)) for t, lp in top]
        content.append(
            TokenLogprob(
                chosen,
                api_logprob(entry[token].logprob),
                list(chosen.encode()),
                [TopLogprob(text, logprob, list(text.encode())) for text, logprob in named],
            )
        )
    return ChatLogprobs(content)


@dataclass(slots=True)
class Reading:
    """How a choice's text becomes its message: a reasoning model's thinking apart (model.reasoning_parser),
    then the calls the model chose (tool_choice "auto"), the rest content (or a forced call's JSON)."""

    think: ThinkSplit | None
    auto: Parser | None
    include_reasoning: bool

    @classmethod
    def start(
        cls, think: str | None, auto: str | None, tools: list[Tool], include_reasoning: bool
    ) -> Reading:
        return cls(
            None if think is None else ThinkSplit(think),
            None if auto is None else parser_for(auto, tools),
            include_reasoning,
        )

    def feed(self, text: str, final: bool) -> tuple[str, str, list[DeltaToolCall]]:
        """(reasoning, content, calls) new in this text."""
        reasoning = ""
        if self.think is not None:
            reasoning, text = self.think.feed(text, final)
        if self.auto is None:
            return reasoning, text, []
        content, calls = self.auto.feed(text, final)
        return reasoning, content, calls

    @property
    def plain(self) -> bool:
        return self.think is None and self.auto is None

    @property
    def called(self) -> bool:
        return self.auto is not None and bool(self.auto.calls)

    def reasoning_field(self, reasoning: str) -> str | UnsetType | None:
        """The message's `reasoning`: left out without a reasoning parser, or when the request asks so."""
        if self.think is None or not self.include_reasoning:
            return UNSET
        return reasoning or None


class Chunks:
    """A stream's chunks: a role chunk to open each choice (as OpenAI), then its content (and reasoning, and
    the calls it chose, as Reading sets them apart), or its tool-call deltas when a call is forced."""

    def __init__(
        self,
        rid: str,
        model: str,
        k: int | None,
        calls: bool,
        call_stream: Callable[[], ToolCallStream],
        body: ChatCompletionRequest,
        role: str,
        echo: str,
        reading: Callable[[], Reading],
        prompt_text: str | UnsetType,
    ) -> None:
        self.rid, self.model, self.k = rid, model, k
        self.prompt_text = prompt_text
        self.role, self.echo = role, echo
        self.reading = reading
        self.readings: dict[int, Reading] = {}  # each choice's
        self.calls: dict[int, ToolCallStream] | None = {} if calls else None
        self.call_stream = call_stream
        self.as_ids, self.return_ids = body.return_tokens_as_token_ids, body.return_token_ids
        self.opened = False  # the stream's first chunk is out (it carries the prompt's ids and text if asked)

    def __call__(self, deltas: list[ChoiceDelta]) -> list[ChatCompletionChunk]:
        out, choices = [], []
        for d in deltas:
            if d.first:
                opening = Delta(role=self.role, content="" if self.calls is None else None)
                out.append(self._chunk([ChatChunkChoice(d.index, opening)]))
                if not self.opened:
                    if self.return_ids:
                        out[-1].prompt_token_ids = d.request.prompt_token_ids
                    out[-1].prompt_text = self.prompt_text
                self.opened = True
                if self.echo and self.calls is None:
                    out.append(self._chunk([ChatChunkChoice(d.index, Delta(content=self.echo))]))
            c = d.output
            logprobs = None
            if self.k is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs or [], self.k, self.as_ids)
            reason = finish(c.finish_reason, self.calls is not None)
            r = self.readings.get(d.index)
            if r is None:
                r = self.readings[d.index] = self.reading()
            reasoning, content, found = r.feed(c.text, final=c.finish_reason is not None)
            shown = reasoning if r.include_reasoning else ""
            if self.calls is not None:
                stream = self.calls.get(d.index)
                if stream is None:
                    stream = self.calls[d.index] = self.call_stream()
                delta = Delta(reasoning=shown or None, tool_calls=stream.feed(content) or None)
            else:
                if r.plain:
                    delta = Delta(content=content)  # as it came, an empty text included
                else:
                    delta = Delta(content=content or None, reasoning=shown or None, tool_calls=found or None)
                reason = "tool_calls" if r.called and reason is not None else reason
            ids = ids_if(self.return_ids, c.token_ids)
            choices.append(ChatChunkChoice(d.index, delta, logprobs, reason, c.stop_reason, ids))
        out.append(self._chunk(choices))
        return out

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, model=self.model, choices=choices)
