"""The engine thread's pause state (kiln.engine.pause): when a pause holds, what it holds back, and what
resume hands back, with a stand-in engine (the server tests, tests/api/test_dev_endpoints.py, run it for
real)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.engine.pause import Pause, Pausing


@dataclass
class Engine:
    unfinished: bool = True
    resets: int = 0

    def has_unfinished(self) -> bool:
        return self.unfinished

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True


@dataclass
class Add:
    request_id: str


@dataclass
class Done:
    calls: list[str] = field(default_factory=list)

    def __call__(self, name: str) -> Pausing:
        return Pausing("wait", name == "first", lambda: self.calls.append(name))


def test_a_wait_pause_holds_once_its_requests_finish_and_every_caller_returns() -> None:
    engine, pause, done = Engine(), Pause(), Done()
    assert not pause.hold(Add("before"))  # not paused: the request goes in
    pause.start(done("first"), engine)
    pause.start(done("second"), engine)  # a second caller while the first waits
    assert pause.hold(Add("a")) and pause.hold(Add("b")) and not pause.frozen
    pause.settle(engine)
    assert done.calls == []  # requests still running
    engine.unfinished = False
    pause.settle(engine)
    assert done.calls == ["first", "second"] and engine.resets == 1  # the first asked to clear the cache
    pause.drop("a")  # a held request whose client left
    assert [a.request_id for a in pause.resume()] == ["b"] and pause.mode is None
    assert not pause.hold(Add("after"))


def test_keep_holds_at_once_and_resume_frees_a_waiting_pause() -> None:
    engine, pause, calls = Engine(), Pause(), []
    pause.start(Pausing("keep", True, lambda: calls.append("keep")), engine)
    assert pause.frozen and calls == ["keep"] and engine.resets == 0  # keep clears nothing
    pause.resume()
    pause.start(Pausing("wait", False, lambda: calls.append("wait")), engine)
    assert calls == ["keep"]  # still running
    pause.resume()  # resumed before it held: its caller returns too
    assert calls == ["keep", "wait"] and not pause.waiting
