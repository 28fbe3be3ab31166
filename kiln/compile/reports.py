"""What a warmup says it did: a report for each bucket, and torch's own compile counters, which also tell
whether anything compiled after ready."""

from __future__ import annotations

from dataclasses import dataclass

from torch._dynamo.utils import counters


@dataclass(slots=True)
class BucketReport:
    bucket: str
    covers: str  # the step sizes that run this bucket's graph
    seconds: float
    # "compiled" (traced, and compiled by Inductor), "cache" (traced, Inductor's code from its cache),
    # "precompiled" (loaded from the compile cache entry: nothing traced), "shared" (an earlier bucket's
    # graph) or "eager"
    source: str

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
