"""How the model's forward runs: eagerly, or lowered by torch.compile (and captured into CUDA graphs), with
the per-bucket warmup that builds every graph before serving, through the compile cache. The lowering owns
its graphs: it pads each step to the shape a graph was built for, picks the graph, and keys the cache by
everything the graphs depend on. It wraps the model without changing it: the model's forward takes what runs
its layers.

CPU lowering: the decoder layers are compiled in equal groups of consecutive layers, at most five calls
a step (30 layers: 5 groups of 6). The layers' weights are graph inputs, so one trace serves every group of
the same layers; on CUDA, a group is one layer. The token dimension is dynamic. Dynamo specializes size 1,
so there are three graph classes (precompiled.graph_class): a decode batch of one, a decode batch of any
other size, and a mixed batch. Warmup runs one bucket of each class; every other bucket shares its class's
graph (BENCHMARKS.md has the static-per-bucket comparison that chose this). Each class is traced once, ahead
of time, and saved with the cache entry, so a warm start traces nothing (precompiled.py)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kiln.compile.buckets import Bucket, BucketPlan
from kiln.compile.buffers import StepBuffers
from kiln.compile.cache import CompileCache, environment
from kiln.compile.cudagraph import CudaGraphs
from kiln.compile.groups import LayerGroups, group_size, kind_suffixes
from kiln.compile.precompiled import GraphStep, compile_layers, graph_class
from kiln.compile.reports import BucketReport, compile_counters
from kiln.models.decoder import DecoderModel, run_layers
from kiln.ops.backend import Backend
from kiln.platform import configure_torch, describe, has_cxx

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PaddedStep:
    num_tokens: int
    num_reqs: int
    width: int  # block-table columns
    graph: bool  # replays (or captures) a CUDA graph of batch num_reqs


class Lowering:
    def __init__(self, model: DecoderModel, mode: str, plan: BucketPlan, backend: Backend) -> None:
        self.model, self.plan, self.backend = model, plan, backend
        self.device = model.embed.weight.device
        cuda = self.device.type == "cuda"
        self.mode = mode
        if self.mode == "auto":
            self.mode = "cudagraph" if cuda else "compiled"
        if self.mode == "compiled" and not cuda and not has_cxx():
            log.warning("no C++ compiler found: compile mode 'compiled' runs eagerly instead (slower)")
            self.mode = "eager"
        if self.mode == "cudagraph" and not cuda:
            raise ValueError("compile mode 'cudagraph' needs a CUDA device; use 'compiled' or 'eager'")
        if self.mode == "cudagraph" and backend.kernels == "torch" and model.dims.num_experts:
            # torch's MoE reference groups the tokens by expert on the host (kiln.ops.moe.grouped): a copy to
            # the host, which a CUDA graph's capture refuses.
            why = "backend.kernels 'torch' runs MoE experts through the host, which a capture cannot hold"
            if mode != "auto":
                raise ValueError(f"compile mode 'cudagraph': {why}; use 'compiled', or kernels 'triton'")
            log.warning("compile mode 'compiled', not 'cudagraph': %s", why)
            self.mode = "compiled"
        self.graphs = CudaGraphs() if self.mode == "cudagraph" else None
        # torch.compile's wrapper, made on the first trace: a start that loads every graph never needs it
        # (making it imports most of AOTAutograd).
        self._compiled: Callable[[], Callable[..., Any]] | None = None
        self.group = 1
        if self.mode in ("compiled", "cudagraph"):
            configure_torch(native_isa=backend.kernels == "cpu")
            self._compiled = functools.cache(functools.partial(compile_layers, run_layers, cuda))
            # On the CPU several layers share a graph: one call per layer cost more than a third of a
            # batch-1 step in dynamo's and the wrapper's per-call work (BENCHMARKS.md, eighth steps).
            self.group = 1 if cuda else group_size(model.dims.num_layers)
        self.suffixes = kind_suffixes(model.layers, self.group)
        # By graph class, and where groups differ in their layers (MoE and dense), by kind of group as well
        # (class + suffix): warmup makes them, serving only runs them.
        self.steps: dict[str, GraphStep] = {}
        self._runs: dict[str, LayerGroups] = {}  # each graph class's steps, group by group
        self.ready = False
        self.misses = 0  # steps after ready whose graph class was never warmed (each ran eagerly)
        self.compile_cache: CompileCache | None = None
        self._warned_unwarmed = False

    def forward(self, graph: str, *args: Any) -> torch.Tensor:
        """The model's forward, with the compiled layer step of the graph class where there is one; before
        ready, a class's first step makes it (loaded or traced)."""
        if self._compiled is None:
            return self.model(*args)
        run = self._runs.get(graph)
        if run is None:
            run = self._runs[graph] = LayerGroups([self._step(graph + s) for s in self.suffixes], self.group)
        return self.model(*args, run=run)

    def _step(self, key: str) -> GraphStep:
        assert self._compiled is not None
        if key not in self.steps:
            self.steps[key] = GraphStep(self._compiled)
        return self.steps[key]

    def pad(self, buf: StepBuffers, num_tokens: int, num_reqs: int, decode_only: bool) -> PaddedStep:
        """Pads the step in buf to a shape a graph serves.

        Shapes are kept off dynamo's size-0/1 specializations, so three graphs serve every step: the block
        table has at least two columns, and a mixed step has at least two requests (an empty one pads). A
        captured decode graph has fixed shapes: the step is padded to its batch with rows that write nothing
        real (slot -1) and read one token of the padding block, and the block table is full width."""
        if not decode_only and num_reqs == 1:
            buf.query_start_loc[2] = num_tokens
            buf.seq_lens[1] = 0
            num_reqs = 2
        graph = self._graph_batch(num_reqs, decode_only)
        if graph is None:
            return PaddedStep(num_tokens, num_reqs, buf.width(num_reqs), False)
        pad = slice(num_reqs, graph)
        buf.input_ids[pad] = 0
        buf.positions[pad] = 0
        buf.slot_mapping[pad] = -1
        buf.lora_slots[pad] = -1
        buf.query_start_loc[num_reqs + 1 : graph + 1] = np.arange(num_reqs + 1, graph + 1)
        buf.seq_lens[pad] = 1
        buf.fill_blocks(pad, buf.padding_block)
        return PaddedStep(graph, graph, buf.block_table.shape[1], True)

    def _graph_batch(self, num_reqs: int, decode_only: bool) -> int | None:
        """The captured (or, during warmup, to be captured) CUDA graph's batch size for this step."""
        if self.graphs is None or not decode_only:
            return None
        bucket = self.plan.bucket(num_reqs, decode_only=True)
        if bucket is None or (self.ready and bucket.size not in self.graphs.captured):
            return None
        return bucket.size

    def warm_buckets(self) -> list[tuple[Bucket, str]]:
        """One bucket per graph class, with the step sizes that share its graph; with CUDA graphs, every
        decode bucket (each is its own graph), largest first so the smaller ones reuse its memory."""
        d, t = self.plan.decode_sizes, self.plan.token_sizes
        if self.graphs is not None:
            decode = [(Bucket("decode", n), f"decode {n} (CUDA graph)") for n in reversed(d)]
            return [*decode, (Bucket("tokens", t[0]), f"mixed 2..{t[-1]} tokens")]
        out = [(Bucket("decode", 1), "decode 1")] if d[0] == 1 else []
        if d[-1] > 1:
            first = next(s for s in d if s > 1)
            out.append((Bucket("decode", first), f"decode 2..{d[-1]}"))
        # Mixed steps share the decode 2.. graph (its warmup step finds it: "shared"), so Inductor sized its
        # loops' threading for a decode's few rows, and runs a loop on one thread where that looks small.
        # That keeps a decode's kernels off thread start-ups, which cost a batch-64 step more than they
        # saved (BENCHMARKS.md, twelfth steps); RoPE, the one such loop that cost a prefill much, is kiln's
        # own kernel on the CPU, split by the step's rows (kiln/ops/cpu/rotary.py). So the smallest mixed
        # step finds that graph as the largest would, in a fraction of the time (a 2,048-token step cost
        # the default model's start 0.9 s). Without a decode 2.. graph (one sequence at a time), mixed steps
        # get a graph of their own, traced at the largest bucket: a prefill's loops then split across
        # threads.
        mixed = t[-1] if d[-1] == 1 else t[0]
        out.append((Bucket("tokens", mixed), f"mixed 2..{t[-1]} tokens"))
        return out

    def _graph_class(self, num_tokens: int, decode_only: bool) -> str:
        return graph_class(num_tokens, decode_only, self.model.attention.own_decode_graph)

    def __call__(self, num_tokens: int, decode_only: bool, *args: Any) -> torch.Tensor:
        if self.graphs is not None and decode_only and num_tokens in self.graphs.captured:
            return self.graphs.replay(num_tokens, args)
        graph = self._graph_class(num_tokens, decode_only)
        if self.graphs is not None and decode_only and not self.ready:
            return self.graphs.capture(num_tokens, functools.partial(self.forward, graph), args)
        if not self.ready or self._compiled is None:
            return self.forward(graph, *args)
        if graph not in self._runs:
            # Once serving nothing is traced: a step of a class warmup never ran (a decode of one where no
            # bucket has size 1) runs eagerly.
            self.misses += 1
            if not self._warned_unwarmed:
                log.warning(
                    "a %s step of %d tokens is of graph class %s, which warmup never ran: running it eagerly "
                    "(logged once)",
                    "decode" if decode_only else "mixed",
                    num_tokens,
                    graph,
                )
                self._warned_unwarmed = True
            return self.model(*args)
        # A decode larger than every CUDA graph runs its class's graph without one (its token dim is dynamic).
        return self.forward(graph, *args)

    def cache_parts(self, block_size: int, kv_dtype: torch.dtype) -> dict[str, Any]:
        """Everything the compiled graphs depend on: a change to any part is a different cache entry."""
        m = self.model
        return {
            "arch": m.spec.name,
            "dims": dataclasses.asdict(m.dims),
            "dtype": str(m.embed.weight.dtype),
            "device": describe(self.device),
            **environment(),
            "options": {
                "mode": self.mode,
                "backend": [self.backend.kernels, self.backend.attention]
                + (["deterministic"] if self.backend.deterministic else []),
                "attention_graph_id": m.attention.graph_id,
                "decode_sizes": self.plan.decode_sizes,
                "token_sizes": self.plan.token_sizes,
                "block_size": block_size,
                "kv_cache_dtype": str(kv_dtype),
                "lora": None if m.lora is None else [m.lora.max_loras, m.lora.max_rank],
            },
        }

    def warmup(
        self,
        run: Callable[[Bucket], None],
        block_size: int,
        kv_dtype: torch.dtype,
        progress: bool,
        cache_file: Path | None = None,
    ) -> list[BucketReport]:
        """Builds every graph before the first request, through the compile cache: a complete entry is
        loaded first, its precompiled graph classes into steps, and Inductor's code into its caches; a
        missing or corrupt one is (re)built and saved. The per-key lock makes concurrent warmups of one key
        take turns. `run` runs one step of a bucket's shape."""
        cache = self.compile_cache = CompileCache(self.cache_parts(block_size, kv_dtype))
        if cache_file is not None:
            cache.import_file(cache_file)
        with cache.lock():
            loaded = cache.load()
            if loaded and self._compiled is not None:
                self.steps = {name: GraphStep(self._compiled, data) for name, data in cache.graphs().items()}
            reports = self._warm(run, progress)
            if not loaded and any(r.source in ("compiled", "cache") for r in reports):
                saved = {name: step.save() for name, step in self.steps.items()}
                graphs = {name: data for name, data in saved.items() if data is not None}
                cache.save([r.as_dict() for r in reports], graphs)
        return reports

    def _warm(self, run: Callable[[Bucket], None], progress: bool) -> list[BucketReport]:
        """Runs one step per graph class, timing each and telling whether its graph was loaded, traced
        (then whether Inductor compiled it or found it in its cache: its own counters say), or built by an
        earlier bucket."""
        reports, warmed = [], set()
        buckets = self.warm_buckets()
        with _no_duck_shapes():
            for bucket, covers in tqdm(buckets, desc="warmup", unit="bucket", disable=not progress):
                graph = self._graph_class(bucket.size, bucket.kind == "decode")
                before = compile_counters()
                clock = time.perf_counter()
                run(bucket)
                seconds = time.perf_counter() - clock
                after = compile_counters()
                if self._compiled is None:
                    source = "eager"
                elif graph in warmed:
                    source = "shared"
                elif all(step.loaded for step in self._runs[graph].steps):
                    source = "precompiled"
                else:  # traced, with Inductor's code compiled now or found in AOTAutograd's or its cache
                    hit = any(after[k] > before[k] for k in ("fxgraph_cache_hit", "autograd_cache_hit"))
                    source = "cache" if hit else "compiled"
                warmed.add(graph)
                reports.append(BucketReport(str(bucket), covers, seconds, source))
                log.info("bucket %s (%s): %s in %.2f s", bucket, covers, source, seconds)
        self.ready = True
        return reports


@contextmanager
def _no_duck_shapes() -> Iterator[None]:
    # By default two dims that happen to be equal while tracing share one symbol, and a later step where
    # they differ would need a new graph. Every warmup shape is traced with independent symbols instead.
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        yield
