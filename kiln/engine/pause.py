"""vLLM's pause and resume of generation (its dev-mode /pause, /resume, /is_paused, as RL trainers use them
around a weight update), kept on the engine thread. While paused, new requests are held, unscheduled, until
resume; the requests already there are aborted first (mode "abort"), run to their end (mode "wait"), or
stay frozen where they are, KV and all (mode "keep"). The pause holds, and its caller returns, once nothing
but frozen requests is left."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kiln.engine.engine import LLMEngine

PauseMode = Literal["abort", "wait", "keep"]


@dataclass(slots=True)
class Pausing:
    mode: PauseMode
    clear_cache: bool  # forget the prefix cache once the pause holds (not under "keep")
    done: Callable[[], None]  # called on the engine thread when it holds


@dataclass(slots=True)
class Resuming:
    pass


@dataclass(slots=True)
class Pause:
    mode: PauseMode | None = None
    held: list[Any] = field(default_factory=list)  # the requests that came while paused, in order
    waiting: list[Pausing] = field(default_factory=list)  # pauses not holding yet (the last one's mode rules)

    @property
    def frozen(self) -> bool:
        return self.mode == "keep"

    def hold(self, add: Any) -> bool:
        """Keeps a new request for resume, if paused."""
        if self.mode is not None:
            self.held.append(add)
        return self.mode is not None

    def drop(self, request_id: str) -> None:
        self.held = [a for a in self.held if a.request_id != request_id]

    def start(self, pausing: Pausing, engine: LLMEngine) -> None:
        self.mode = pausing.mode
        self.waiting.append(pausing)
        self.settle(engine)

    def settle(self, engine: LLMEngine) -> None:
        """Called after every step: a pause holds once only frozen requests are left."""
        if not self.waiting or (self.mode != "keep" and engine.has_unfinished()):
            return
        if self.mode != "keep" and any(p.clear_cache for p in self.waiting):
            engine.reset_prefix_cache()
        self._done()

    def resume(self) -> list[Any]:
        """The held requests, to be added now; a pause still waiting for its requests returns too."""
        self._done()
        held, self.held, self.mode = self.held, [], None
        return held

    def _done(self) -> None:
        for p in self.waiting:
            p.done()
        self.waiting = []
