"""Builds, in one parallel ninja run, every FlashInfer module the GPU tests and benchmark load."""

import itertools
import logging
import time

import torch

from kiln.compile.cache import point_caches
from kiln.paths import cache_root

point_caches(cache_root())
from flashinfer.jit import build_jit_specs  # noqa: E402

from kiln.ops.flashinfer_attention import kernel_specs  # noqa: E402

logging.basicConfig(level=logging.INFO)
dev = torch.device("cuda")
specs = {}
combos = [(hd, w, False) for hd, w in itertools.product((128, 64), (False, True))] + [(128, False, True)]
for hd, window, tc in combos:
    for spec in kernel_specs(hd, torch.bfloat16, dev, window, tc):
        specs[spec.name] = spec
clock = time.time()
build_jit_specs(list(specs.values()))
print(f"prebuild: {len(specs)} FlashInfer modules ready in {time.time() - clock:.1f} s", flush=True)
