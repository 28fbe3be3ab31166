"""Builds, in one parallel ninja run, every FlashInfer module the GPU tests and benchmark load; then kiln's
CPU kernels with `--cpu-kernels` (test_end_to_end's CPU reference loads them). `--bench` builds only what
perf/gpu_bench.py loads (5 modules): a run that only benchmarks spends its device time on the benchmark (all
13 took 176 s on an H100 machine).

`--aot 9.0a` builds them with no GPU, for that architecture (Hopper), into FlashInfer's AOT folder of the
flashinfer package it imports: perf/gpu_prepare.sh does this on a CPU machine with CUDA's nvcc, so the GPU
machine loads them and builds nothing. Then `--check` on the GPU machine loads each AOT module and removes
any that fails, which FlashInfer then builds as it would have."""

import argparse
import itertools
import logging
import os
import shutil
import tempfile
import time

parser = argparse.ArgumentParser()
parser.add_argument("--bench", action="store_true", help="only gpu_bench's modules")
parser.add_argument("--aot", metavar="ARCH", help="build for this arch, with no GPU")
parser.add_argument("--check", action="store_true", help="load the AOT modules; remove those that fail")
parser.add_argument("--cpu-kernels", action="store_true", help="then build kiln's CPU kernels")
args = parser.parse_args()
if args.aot:
    # Read when flashinfer is imported; the builds go to a scratch workspace, only the libraries are kept.
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = args.aot
    os.environ["FLASHINFER_WORKSPACE_BASE"] = tempfile.mkdtemp(prefix="flashinfer-aot-")
else:
    from kiln.compile.cache import point_caches
    from kiln.paths import cache_root

    point_caches(cache_root())

import torch  # noqa: E402
from flashinfer.jit import build_jit_specs  # noqa: E402
from flashinfer.jit import env as jit_env  # noqa: E402

from kiln.ops.flashinfer_modules import kernel_specs, prefill_backend  # noqa: E402

logging.basicConfig(level=logging.INFO)
# gpu_bench's models, bfloat16 at head dim 128: the Llama-3-8B shape decodes on tensor cores (4 query heads
# a KV head), the Qwen3-0.6B shape (2) on CUDA cores.
combos = [(128, False, tc, torch.bfloat16, torch.bfloat16) for tc in (False, True)]
if not args.bench:
    bf16 = torch.bfloat16
    combos += [(hd, w, False, bf16, bf16) for hd, w in itertools.product((128, 64), (False, True))]
    # float16: `dtype: auto` on a float32 folder, as test_serve's tiny model is (vLLM's choice too).
    combos.append((128, False, False, torch.float16, torch.float16))
    # --kv-cache-dtype fp8 (tests/gpu/test_kv_cache_dtype.py): FA2 prefill, on either decode.
    combos += [(128, False, tc, bf16, torch.float8_e4m3fn) for tc in (False, True)]
specs = {}
for hd, window, tc, dtype, kv_dtype in combos:
    # FlashInfer's `auto`: FA3 on Hopper (sm_90a) but for an fp8 cache, FA2 elsewhere.
    if args.aot:
        prefill = "fa3" if args.aot.startswith("9.0") and kv_dtype == dtype else "fa2"
    else:
        prefill = prefill_backend(dtype, kv_dtype, torch.device("cuda"))
    for spec in kernel_specs(hd, dtype, kv_dtype, prefill, window, tc):
        specs[spec.name] = spec
aot_arch = jit_env.FLASHINFER_AOT_DIR / "arch"  # what --aot built for
if args.check:
    here = "{}.{}".format(*torch.cuda.get_device_capability())
    built_for = aot_arch.read_text() if aot_arch.exists() else "an unknown GPU"
    for spec in specs.values():
        if spec.is_aot:
            try:
                if not built_for.startswith(here):
                    raise RuntimeError(f"built for {built_for}, this GPU is {here}")
                spec.load(spec.aot_path)
            except Exception as e:  # whatever the failure, the JIT build replaces it
                print(f"prebuild: AOT {spec.name} removed: {e}", flush=True)
                shutil.rmtree(spec.aot_path.parent)
    aot = sum(spec.is_aot for spec in specs.values())
    print(f"prebuild: {aot} of {len(specs)} FlashInfer modules come built (AOT)", flush=True)
clock = time.time()
build_jit_specs(list(specs.values()))
print(f"prebuild: {len(specs)} FlashInfer modules ready in {time.time() - clock:.1f} s", flush=True)
if args.aot:
    for spec in specs.values():
        if not spec.is_aot:
            spec.aot_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(spec.jit_library_path, spec.aot_path)
    aot_arch.write_text(args.aot)
    shutil.rmtree(os.environ["FLASHINFER_WORKSPACE_BASE"])
    print(f"prebuild: {len(specs)} modules for {args.aot} in {jit_env.FLASHINFER_AOT_DIR}", flush=True)
elif args.cpu_kernels:
    from kiln.ops.cpu import native

    # kiln's CPU kernels, which test_end_to_end's CPU reference loads: built once here, not by each of its
    # xdist workers at the same moment.
    clock = time.time()
    native.load()
    print(f"prebuild: kiln's CPU kernels ready in {time.time() - clock:.1f} s", flush=True)
