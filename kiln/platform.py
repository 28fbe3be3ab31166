"""Every question kiln asks of the machine, answered in one place: which device, what it is, whether a C++
compiler is there for Inductor, and which dtypes its matrix multiplies run natively. The process-wide
torch and allocator settings kiln changes are set here too, once (`configure_torch`, `keep_freed_memory`)."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil

import torch


def resolve_device(device: str) -> torch.device:
    """`auto` is the GPU where there is one (as vLLM), else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def describe(device: torch.device) -> str:
    """What compiled code depends on: the GPU's name and compute capability, or the CPU's vector ISA."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    return f"{device.type}:{torch.backends.cpu.get_cpu_capability()}:{platform.machine()}"


@functools.cache
def cxx() -> str | None:
    """The C++ compiler Inductor's CPU backend and kiln's CPU kernels build with ($CXX, g++ or clang++)."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")


def has_cxx() -> bool:
    """Without a compiler, CPU code runs eagerly and kiln's CPU kernels are not built."""
    return cxx() is not None


def native_matmul_dtypes(device: torch.device) -> set[torch.dtype]:
    """Dtypes whose matmuls the device runs natively. A CPU without AVX512-BF16/AMX runs a bf16 GEMM
    about ten times slower than fp32 (measured on the 2-core AVX2 machine), so kiln upcasts there."""
    if device.type != "cpu":
        return {torch.float32, torch.bfloat16, torch.float16}
    native = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        native.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        native.add(torch.float16)
    return native


def configure_torch(native_isa: bool = False) -> None:
    """The process-wide torch settings kiln needs, set before anything is compiled.

    - dynamo's recompile limit: its compile cache is per code object and shared by the whole process, and
      a process may build many models (the tests do). The lowering's layer graphs are precompiled functions
      outside that cache, but the torch attention's shared paged-decode kernel sees every model's shapes.
    - native_isa: kiln's CPU kernels were built with -march=native by the compiler Inductor uses (cxx), so
      it takes every vector ISA the CPU reports. Inductor then skips proving it again, which it does in
      every process by loading a probe library per ISA in a Python subprocess: 0.5-0.9 s of a 7 s warm
      start (BENCHMARKS.md). AMX is still probed, as Linux must grant its tile state."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if native_isa:
        from torch._inductor import config

        config.cpp.vec_isa_ok = True


@functools.cache
def keep_freed_memory() -> bool:
    """Has glibc keep freed blocks up to 32 MiB for reuse (its largest mmap threshold), rather than handing
    them back to the kernel: on a CPU a step's activations are freed and allocated again every step, and
    each page of a returned block faults in anew, 9% of a 2,048-token prefill (BENCHMARKS.md, ninth
    steps). Returns whether glibc took the settings."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    trim_threshold, mmap_threshold = -1, -3  # malloc.h's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(mmap_threshold, 32 << 20)) and bool(libc.mallopt(trim_threshold, 1 << 30))
