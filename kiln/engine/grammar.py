"""Structured output with xgrammar: a constraint (StructuredOutputsParams) is checked when a request
arrives, compiled against the tokenizer on a thread of its own (never on the step loop), and kept in an
LRU cache; each sequence then has a matcher, which fills its row of a step's token bitmask and advances
by the tokens it samples."""

from __future__ import annotations

import bisect
import concurrent.futures
import functools
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kiln.engine.constraint import Constraint
from kiln.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

CACHE_ENTRIES = 128  # compiled grammars kept; SmolLM2's are tens of kB to a few MB each
# xgrammar's own cache, of the token masks of rules: a schema whose 40 fields share a pattern compiles in
# 0.07 s with it and 1.9 s without, as does one that repeats another's patterns (vLLM keeps 512 MiB).
COMPILER_CACHE_BYTES = 256 * 2**20
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+: ")  # "[08:50:55] /project/cpp/x.cc:83: " before its message


def _xgr_message(error: Exception) -> str:
    return _XGR_PREFIX.sub("", str(error).strip()).strip()


@dataclass(slots=True, eq=False)
class SequenceGrammar:
    """One sequence's place in its grammar. The matcher is made once the grammar has compiled."""

    compiled: Future[xgr.CompiledGrammar]
    matcher: xgr.GrammarMatcher | None = None
    failed: bool = False  # compiling failed, or a sampled token broke the grammar

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    @property
    def active(self) -> bool:
        """Constrains this step's token: compiled, and not yet at its end (after which the sequence is free,
        as with ignore_eos)."""
        if self.failed:
            return False
        if self.matcher is None:
            import xgrammar as xgr

            try:
                self.matcher = xgr.GrammarMatcher(self.compiled.result())
            except Exception:
                log.exception("a grammar failed to compile")
                self.failed = True
                return False
        return not self.matcher.is_terminated()

    @property
    def ended(self) -> bool:
        """It has accepted its end (a stop token)."""
        return self.matcher is not None and self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        if self.matcher is None or self.matcher.is_terminated():
            return True
        if self.matcher.accept_token(token):
            return True
        self.failed = True
        return False


def _structural_tag(text: str) -> xgr.Grammar:
    """xgrammar's structural tag: its current form ({"type": "structural_tag", "format": ...}), or the one
    vLLM's response_format still takes ({"structures": [{"begin", "schema", "end"}], "triggers"})."""
    import xgrammar as xgr

    tag = json.loads(text)
    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(text)
    try:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
    except (KeyError, TypeError):
        raise ValueError("each of its structures needs begin, schema and end") from None
    return xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))


@dataclass(slots=True)
class _Entry:
    grammar: xgr.Grammar
    compiled: Future[xgr.CompiledGrammar] | None = None


@dataclass(slots=True)
class GrammarStats:
    hits: int = 0
    misses: int = 0
    compile_buckets: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_BUCKETS) + 1))
    compile_seconds: float = 0.0

    def observe(self, seconds: float) -> None:
        self.compile_buckets[bisect.bisect_left(COMPILE_BUCKETS, seconds)] += 1
        self.compile_seconds += seconds


class Grammars:
    """The engine's constraints: `check` on any thread when a request arrives (parsing only: a bad
    constraint is a ValueError before anything is queued), `start` on the engine's thread when it is
    queued (compiling on the grammar thread), `bitmask` for each step's constrained rows. xgrammar is
    imported, and its view of the tokenizer built, on the grammar thread, so a server that never sees a
    constraint never pays for them."""

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_ids: set[int], compact: bool = False
    ) -> None:
        """compact: every JSON constraint without whitespace (structured_outputs_config's)."""
        self.vocab_size = vocab_size
        self.compact = compact
        self.stats = GrammarStats()
        self._lock = threading.Lock()
        self._entries: OrderedDict[Constraint, _Entry] = OrderedDict()
        self._pending: set[Future[Any]] = set()
        # The engine's thread may be pinned to one CPU once warm (backend.cpu_threads_bind); the grammar
        # thread, started from it later, takes back the CPUs it has now.
        initializer = None
        if hasattr(os, "sched_setaffinity"):
            initializer = functools.partial(os.sched_setaffinity, 0, os.sched_getaffinity(0))
        self._pool = ThreadPoolExecutor(1, "kiln-grammar", initializer)
        self._compiler: Future[tuple[xgr.GrammarCompiler, xgr.GrammarCompiler]] | None = None
        self._load_tokenizer, self._stop_ids = load_tokenizer, sorted(stop_ids)
        self._bitmask: torch.Tensor | None = None  # the engine thread's, reused every step
        self._batch: xgr.BatchGrammarMatcher | None = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check(self, params: StructuredOutputsParams) -> Constraint:
        """Parses the constraint (cached); raises ValueError naming what is wrong with it."""
        if not self._stop_ids:  # xgrammar ends a grammar on a stop token, and refuses a tokenizer without one
            raise ValueError("structured output needs a model with an end-of-sequence token; it has none")
        constraint = Constraint.of(params, self.compact)
        self._entry(constraint)
        return constraint

    def _entry(self, c: Constraint) -> _Entry:
        with self._lock:
            entry = self._entries.get(c)
            if entry is not None:
                self._entries.move_to_end(c)
                return entry
        import xgrammar as xgr

        try:
            if c.kind == "json":
                # Compact, as vLLM asks xgrammar for it: no whitespace, nor after its separators.
                compact = None if c.any_whitespace else (",", ":")
                grammar = xgr.Grammar.from_json_schema(
                    c.text, any_whitespace=c.any_whitespace, separators=compact
                )
            elif c.kind == "regex":
                grammar = xgr.Grammar.from_regex(c.text)
            elif c.kind == "structural_tag":
                grammar = _structural_tag(c.text)
            else:
                grammar = xgr.Grammar.from_ebnf(c.text)
        except Exception as e:  # xgrammar raises RuntimeError (or its own errors) with the parser's message
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(
                c.kind, "structural tag"
            )
            raise ValueError(f"invalid {what} for structured output: {_xgr_message(e)}") from None
        with self._lock:
            entry = self._entries.setdefault(c, _Entry(grammar))
            self._entries.move_to_end(c)
            while len(self._entries) > CACHE_ENTRIES:
                self._entries.popitem(last=False)
            return entry

    def start(self, constraint: Constraint) -> SequenceGrammar:
        """A sequence's grammar (`check`'s constraint): compiled once per distinct constraint, then shared
        from the cache."""
        entry = self._entry(constraint)
        with self._lock:
            if entry.compiled is None:
                self.stats.misses += 1
                if self._compiler is None:
                    self._compiler = self._pool.submit(self._make_compiler)
                entry.compiled = self._pool.submit(self._compile, entry.grammar)
                self._pending.add(entry.compiled)
                entry.compiled.add_done_callback(self._pending.discard)
            else:
                self.stats.hits += 1
            return SequenceGrammar(entry.compiled)

    def _make_compiler(self) -> tuple[xgr.GrammarCompiler, xgr.GrammarCompiler]:
        """The compiler with xgrammar's cache, and one without for what that one fails on."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self._stop_ids
        )
        cached = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILER_CACHE_BYTES)
        return cached, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        assert self._compiler is not None
        cached, uncached = self._compiler.result()
        clock = time.perf_counter()
        try:
            compiled = cached.compile_grammar(grammar)
        except RuntimeError as e:
            # xgrammar 0.2.8's cache hashes each rule's automaton and fails a check on some valid grammars
            # (mlc-ai/xgrammar#647: 40 string fields with patterns [a-z]{3,120..159}[0-9]{2,9}).
            log.warning("compiling without xgrammar's cache, which failed: %s", _xgr_message(e))
            compiled = uncached.compile_grammar(grammar)
        seconds = time.perf_counter() - clock
        self.stats.observe(seconds)
        log.debug("compiled a grammar in %.3f s", seconds)
        return compiled

    def wait(self, timeout: float) -> None:
        """Until a grammar being compiled is ready, or timeout: what the step loop does when every
        waiting request waits for one."""
        with self._lock:
            pending = list(self._pending)
        if pending:
            concurrent.futures.wait(pending, timeout, concurrent.futures.FIRST_COMPLETED)

    def bitmask(
        self,
        grammars: list[SequenceGrammar],
        rows: list[int],
        num_rows: int,
        also: Sequence[tuple[int, int]] = (),
    ) -> torch.Tensor:
        """[num_rows, ceil(vocab / 32)] int32 on the CPU, with the given rows filled (a set bit allows
        the token); the other rows are left as they are and must not be applied. also: (row, token)
        allowed beside the grammar's (a reasoning model's opening tag, kiln.engine.thinking)."""
        import xgrammar as xgr

        if self._bitmask is None or len(self._bitmask) < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 16), self.vocab_size)
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], self._bitmask, rows)
        if also:
            words = self._bitmask.numpy().view(np.uint32)
            for row, token in also:
                words[row, token >> 5] |= np.uint32(1 << (token & 31))
        return self._bitmask[:num_rows]

    def keep_ends(self, bitmask: torch.Tensor, rows: list[int], banned: list[list[int]]) -> None:
        """min_tokens bans EOS and the stop ids until it is met, and a grammar at its end (a short schema,
        complete) allows nothing else: the row would have no token to draw. The grammar wins, as in vLLM
        (#54218): such a row's ban is lifted, in place, and the end it draws ends it (OutputProcessor)."""
        held = [row for row in rows if banned[row]]  # min_tokens not yet met
        if not held:
            return
        full, tail = divmod(self.vocab_size, 32)
        allowed = bitmask.numpy().view(np.uint32)[held, : full + (tail > 0)]  # a copy
        if tail:
            allowed[:, -1] &= np.uint32((1 << tail) - 1)  # the bits past the vocabulary
        pairs = [(i, t) for i, row in enumerate(held) for t in banned[row] if 0 <= t < self.vocab_size]
        which, ids = np.array(pairs, dtype=np.int64).reshape(-1, 2).T
        np.bitwise_and.at(allowed, (which, ids >> 5), ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        for i in np.flatnonzero(~allowed.any(axis=1)):
            banned[held[i]] = []
