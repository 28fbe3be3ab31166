"""Builds, in one parallel ninja run, every FlashInfer module the GPU tests and benchmark load; then kiln's
CPU kernels. `--bench` builds only what perf/gpu_bench.py loads (5 modules, no CPU kernels): a run that
only benchmarks spends its device time on the benchmark (all 13 took 176 s on an H100 machine)."""

import argparse
import itertools
import logging
import time

import torch

from kiln.compile.cache import point_caches
from kiln.paths import cache_root

point_caches(cache_root())
from flashinfer.jit import build_jit_specs  # noqa: E402

from kiln.ops.cpu import native  # noqa: E402
from kiln.ops.flashinfer_attention import kernel_specs  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--bench", action="store_true", help="only gpu_bench's modules")
bench = parser.parse_args().bench
logging.basicConfig(level=logging.INFO)
dev = torch.device("cuda")
specs = {}
# gpu_bench's models, bfloat16 at head dim 128: the Llama-3-8B shape decodes on tensor cores (4 query heads
# a KV head), the Qwen3-0.6B shape (2) on CUDA cores.
combos = [(128, False, tc, torch.bfloat16) for tc in (False, True)]
if not bench:
    combos += [(hd, w, False, torch.bfloat16) for hd, w in itertools.product((128, 64), (False, True))]
    # float16: `dtype: auto` on a float32 folder, as test_serve's tiny model is (vLLM's choice too).
    combos.append((128, False, False, torch.float16))
for hd, window, tc, dtype in combos:
    for spec in kernel_specs(hd, dtype, dev, window, tc):
        specs[spec.name] = spec
clock = time.time()
build_jit_specs(list(specs.values()))
print(f"prebuild: {len(specs)} FlashInfer modules ready in {time.time() - clock:.1f} s", flush=True)
if not bench:
    # kiln's CPU kernels, which test_end_to_end's CPU reference loads: built once here, not by each of its
    # xdist workers at the same moment.
    clock = time.time()
    native.load()
    print(f"prebuild: kiln's CPU kernels ready in {time.time() - clock:.1f} s", flush=True)
