"""Dynamo's part of compiling, done once per graph class: torch.compile's aot_compile traces the layer step
into a function that is saved with the compile cache entry, so a later start loads it and traces nothing
(tracing was most of a warm start's compile time). The functions keep no guards, as vLLM's do, so whatever a
trace bakes in is kiln's to tell apart: the lowering picks a step's graph by its class and its group's kind
of layers, the cache entry's key holds the model, backend and buckets (and the attention instance's
graph_id), and the KV caches' block count is traced dynamic, as each start sizes the cache anew. A graph
that does not fit its inputs fails Inductor's size checks rather than computing."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.compile.groups import mark_step_dims

log = logging.getLogger(__name__)


def graph_class(num_tokens: int, decode_only: bool, own_decode_graph: bool) -> str:
    """Dynamo specializes a size of 1, so a decode batch of one is a graph of its own. A mixed step runs
    the decode graph unless the attention traces decode steps apart (the torch backend does): the layer
    graph is then the same, and so are Inductor's loops, sized for a decode's few rows."""
    if decode_only and num_tokens == 1:
        return "decode-1"
    return "mixed" if not decode_only and own_decode_graph else "decode"


def no_guards(entries: Sequence[Any]) -> list[bool]:
    return [False] * len(entries)


def compile_layers(fn: Callable[..., Any], cuda: bool) -> Callable[..., Any]:
    """torch.compile's wrapper of the layer step, with aot_compile: one graph each call, no guards kept. On
    the CPU a layer's graph runs through a C++ wrapper: the Python one spent longer calling the kernels and
    checking their arguments than the elementwise kernels take."""
    options: dict[str, Any] = {"guard_filter_fn": no_guards}
    if not cuda:
        options["cpp_wrapper"] = True
    with torch._dynamo.config.patch(enable_aot_compile=True):
        return torch.compile(fn, dynamic=False, fullgraph=True, options=options)


class GraphStep:
    """One graph class's compiled layer step, made on its first call (the warmup's step of that class):
    loaded from what a cache entry saved, or else traced with the step's dims marked dynamic."""

    def __init__(self, compiled: Callable[[], Callable[..., Any]], saved: bytes | None = None) -> None:
        """compiled: makes (or returns) compile_layers' wrapper; saved: what save() returned in an earlier
        process."""
        self.compiled, self.saved = compiled, saved
        self.fn: Callable[..., Any] | None = None
        self.loaded = False

    def __call__(self, layers: tuple[torch.nn.Module, ...], *args: Any) -> Any:
        if self.fn is None:
            self.fn = self._load()
        if self.fn is None:
            mark_step_dims(args)
            self.fn = self.compiled().aot_compile(((layers, *args), {}))
            # It has no guards to check, and checking binds the arguments to a signature every call.
            self.fn.disable_guard_check()
        return self.fn(layers, *args)

    def _load(self) -> Callable[..., Any] | None:
        if self.saved is None:
            return None
        try:
            fn = torch.compiler.load_compiled_function(io.BytesIO(self.saved))
        except Exception as e:  # an entry torch cannot read is traced again, never fatal
            log.warning("a precompiled graph did not load (%s); tracing it again", e)
            return None
        fn.disable_guard_check()
        self.loaded, self.saved = True, None
        return fn

    def save(self) -> bytes | None:
        """The traced function, serialized; None when it was loaded, never run, or torch cannot save it."""
        if self.fn is None or self.loaded:
            return None
        try:
            return type(self.fn).serialize(self.fn).serialized_data
        except Exception as e:  # the next start traces this class again, as it would without an entry
            log.warning("a traced graph could not be saved (%s: %s)", type(e).__name__, e)
            return None
