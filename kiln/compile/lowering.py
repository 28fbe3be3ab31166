"""How the model's forward runs: eagerly, or lowered by torch.compile, and the per-bucket warmup that
builds every graph before serving.

CPU lowering: each decoder layer is compiled on its own (they share one code object, so dynamo traces
one layer and every layer reuses its graph) with a dynamic token dimension. Dynamo specializes size 1,
so there are three graph classes: a batch of one, a decode batch of any other size, and a mixed batch.
Warmup runs one bucket of each class; every other bucket shares those graphs (BENCHMARKS.md has the
static-per-bucket comparison that chose this)."""

from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.utils import counters
from tqdm import tqdm

from kiln.compile.buckets import Bucket, BucketPlan
from kiln.compile.cudagraph import CudaGraphs
from kiln.config import EngineConfig
from kiln.models.decoder import DecoderModel
from kiln.ops.attention import AttnMetadata, has_cxx

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BucketReport:
    bucket: str
    covers: str  # the step sizes that run this bucket's graph
    seconds: float
    source: str  # "compiled", "cache" (loaded from the compile cache) or "shared" (an earlier bucket's graph)

    def as_dict(self) -> dict[str, str | float]:
        return {"bucket": self.bucket, "covers": self.covers, "seconds": self.seconds, "source": self.source}


def compile_counters() -> dict[str, int]:
    """torch's own counters for this process: frames dynamo converted and graphs it produced, Inductor's
    FX-graph cache and AOTAutograd's. Unchanged across a workload means nothing was compiled during it."""
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "dynamo_frames": counters["frames"]["total"],
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "fxgraph_cache_miss": inductor["fxgraph_cache_miss"],
        "fxgraph_cache_hit": inductor["fxgraph_cache_hit"],
        "autograd_cache_miss": aot["autograd_cache_miss"],
        "autograd_cache_hit": aot["autograd_cache_hit"],
    }


class Lowering:
    def __init__(self, model: DecoderModel, config: EngineConfig, plan: BucketPlan) -> None:
        self.model = model
        self.plan = plan
        cuda = model.embed.weight.device.type == "cuda"
        self.mode = config.compile.mode
        if self.mode == "auto":
            self.mode = "cudagraph" if cuda else "compiled"
        if self.mode == "compiled" and not cuda and not has_cxx():
            log.warning("no C++ compiler found: compile mode 'compiled' runs eagerly instead (slower)")
            self.mode = "eager"
        if self.mode == "cudagraph" and not cuda:
            raise ValueError("compile mode 'cudagraph' needs a CUDA device; use 'compiled' or 'eager'")
        self.graphs = CudaGraphs() if self.mode == "cudagraph" else None
        if self.mode in ("compiled", "cudagraph"):
            # Dynamo's compile cache is per code object and process-wide: tests build many models.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            # A copy of the function with its own code object gets its own dynamo cache: this model's
            # graphs never mix with another model's in the same process (see __call__'s guard skipping).
            fn = _layer_forward
            own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
            step = torch.compile(own, dynamic=False, fullgraph=True)
            for layer in model.layers:
                layer.forward = functools.partial(_marked_layer, step, layer)
        self.ready = False
        self.misses = 0  # steps after ready that matched no warmed graph (each ran eagerly, never compiled)
        self._warned_outside = False
        self._skip_guards = True

    def graph_batch(self, num_reqs: int, decode_only: bool) -> int | None:
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
        out.append((Bucket("tokens", t[0]), f"mixed 2..{t[-1]} tokens"))
        return out

    def __call__(self, num_tokens: int, decode_only: bool, *args: Any) -> torch.Tensor:
        if self.graphs is not None and decode_only and num_tokens in self.graphs.captured:
            return self.graphs.replay(num_tokens, args)
        if self.graphs is not None and decode_only and not self.ready:
            return self.graphs.capture(num_tokens, self.model, args)
        if not self.ready:
            return self.model(*args)
        if self.plan.bucket(num_tokens, decode_only) is None:
            if not self._warned_outside:
                log.warning(
                    "a %s step of %d tokens is outside the compiled buckets: running it eagerly "
                    "(logged once)",
                    "decode" if decode_only else "mixed",
                    num_tokens,
                )
                self._warned_outside = True
            with torch.compiler.set_stance("force_eager"):
                return self.model(*args)
        # Once serving, a guard that would need a new graph runs eagerly instead of compiling; and only
        # the guards that tell the warmed graphs apart are evaluated (per layer call, the full set cost
        # more than the layer's own elementwise work on the CPU). Should a step still miss every graph,
        # that stance raises before or between layers; a forward is idempotent (it writes the same KV
        # slots with the same values), so the step reruns with every guard checked, and so do later ones.
        if self._skip_guards:
            try:
                with torch.compiler.set_stance("eager_on_recompile", skip_guard_eval_unsafe=True):
                    return self.model(*args)
            except RuntimeError as e:
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
                log.warning("a step matched no warmed graph; checking every guard from now on: %s", e)
                self.misses += 1
                self._skip_guards = False
        with torch.compiler.set_stance("eager_on_recompile"):
            return self.model(*args)

    def warmup(self, run: Callable[[Bucket], None], progress: bool) -> list[BucketReport]:
        """Runs one step per graph class, timing each and asking Inductor's counters whether it compiled,
        loaded from the cache, or reused a graph built earlier in this process."""
        reports = []
        buckets = self.warm_buckets()
        with _no_duck_shapes():
            for bucket, covers in tqdm(buckets, desc="warmup", unit="bucket", disable=not progress):
                before = compile_counters()
                clock = time.perf_counter()
                run(bucket)
                seconds = time.perf_counter() - clock
                after = compile_counters()
                compiled = after["fxgraph_cache_miss"] > before["fxgraph_cache_miss"]
                loaded = after["fxgraph_cache_hit"] > before["fxgraph_cache_hit"]
                source = "compiled" if compiled else "cache" if loaded else "shared"
                reports.append(BucketReport(str(bucket), covers, seconds, source))
                log.info("bucket %s (%s): %s in %.2f s", bucket, covers, source, seconds)
        self.ready = True
        return reports


def _layer_forward(layer: torch.nn.Module, *args: Any) -> Any:
    return type(layer).forward(layer, *args)


def _marked_layer(
    step: Callable[..., Any],
    layer: torch.nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor | None,
    kv_cache: torch.Tensor,
    meta: AttnMetadata,
) -> Any:
    """Marks only the step-dependent dims dynamic. Leaving every dim dynamic (dynamic=True) also made the
    KV cache's and weights' dims symbolic, and tracing spent most of its time on them."""
    for t in (x, residual, positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(meta.block_table, 0)
    torch._dynamo.maybe_mark_dynamic(meta.block_table, 1)
    return step(layer, x, residual, positions, cos_sin, kv_cache, meta)


@contextmanager
def _no_duck_shapes() -> Iterator[None]:
    # By default two dims that happen to be equal while tracing share one symbol, and a later step where
    # they differ would need a new graph. Every warmup shape is traced with independent symbols instead.
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        yield
