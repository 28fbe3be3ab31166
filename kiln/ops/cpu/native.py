"""Builds kernels.cpp (one translation unit: it includes its parts, vec.h, linear.h, attention.h, ...)
into a torch op library once per machine, and loads it.

The library lands in `<KILN_CACHE_DIR>/cpu-kernels/<key>/`, keyed by the sources, torch's version and
C++ ABI, the compiler and the CPU's vector ISA; it is written under a temporary name and renamed into
place, so a half-built library is never loaded and two processes building at once both end with a whole
one. It links torch's own OpenMP runtime, so its threads are torch's (`torch.set_num_threads`)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kiln.paths import cache_root
from kiln.platform import cxx, describe

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
PARTS = sorted(SOURCE.parent.glob("*.h"))  # included by SOURCE


def _command(cxx: str, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    lib = cpp_extension.library_paths()[0]
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # No fast-math and no contraction: the kernels' FMAs are written out, and nothing else may be fused
    # differently in one instantiation than in another.
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-w"]
    return [
        cxx, *flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(SOURCE), "-o", str(out),
        f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
    ]  # fmt: skip


def _key(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    parts = [SOURCE.read_bytes(), *(p.read_bytes() for p in PARTS)]
    parts += [torch.__version__.encode(), str(version).encode()]
    parts.append(f"{torch._C._GLIBCXX_USE_CXX11_ABI}:{describe(torch.device('cpu'))}".encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


class BuildError(RuntimeError):
    pass


def _compiler() -> str:
    compiler = cxx()
    if compiler is None:
        raise BuildError("no C++ compiler found (set CXX or install g++)")
    return compiler


def folder(compiler: str | None = None) -> Path:
    """Where this machine's build of the library lives (or will): keyed as the module's docstring says."""
    return cache_root() / "cpu-kernels" / _key(compiler or _compiler())


@functools.cache
def load() -> None:
    """Builds (first use on this machine) and loads the library; raises BuildError if it cannot."""
    compiler = _compiler()
    target = folder(compiler)
    library = target / "kernels.so"
    if not library.is_file():
        target.mkdir(parents=True, exist_ok=True)
        log.info("building kiln's CPU kernels once for this machine into %s", target)
        clock = time.perf_counter()
        fd, tmp = tempfile.mkstemp(dir=target, suffix=".so.tmp")
        os.close(fd)
        result = subprocess.run(_command(compiler, Path(tmp)), capture_output=True, text=True)
        if result.returncode != 0:
            Path(tmp).unlink(missing_ok=True)
            raise BuildError(f"building {SOURCE.name} failed:\n{result.stderr[-4000:]}")
        os.replace(tmp, library)
        log.info("built kiln's CPU kernels in %.1f s", time.perf_counter() - clock)
    torch.ops.load_library(str(library))
    _register_fakes()


def _register_fakes() -> None:
    @torch.library.register_fake("kiln_cpu::linear")
    def _(x: torch.Tensor, w: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty(x.shape[0], n, dtype=torch.float32)

    @torch.library.register_fake("kiln_cpu::gate_up")
    def _(x: torch.Tensor, w: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty(x.shape[0], n, dtype=torch.bfloat16)

    @torch.library.register_fake("kiln_cpu::rotary")
    def _(positions, q, k, cos_sin):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake("kiln_cpu::write_kv")
    def _(k, v, kv_cache, slot_mapping, pairs):
        return None

    @torch.library.register_fake("kiln_cpu::paged_attention")
    def _(q, kv_cache, query_start_loc, seq_lens, block_table, scale, sliding_window, pairs):
        return torch.empty_like(q)


@functools.cache
def bf16_dot() -> bool:
    """Whether the kernels were built with AVX512-BF16, so linear takes pair-packed bfloat16 weights."""
    load()
    return bool(torch.ops.kiln_cpu.bf16_dot())


@functools.cache
def amx() -> bool:
    """Whether the kernels multiply bfloat16 pairs on AMX tiles here (built with AMX, and granted the tile
    state by Linux)."""
    load()
    return bool(torch.ops.kiln_cpu.amx())


@functools.cache
def available() -> str | None:
    """None when the kernels are loaded, else why not (logged once by the backend choice)."""
    try:
        load()
    except BuildError as e:
        return str(e)
    return None
