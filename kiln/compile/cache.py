"""The persistent compile cache: one entry per key under `<KILN_CACHE_DIR>/compile/<key>/`.

An entry holds torch's portable cache artifacts (`torch.compiler.save_cache_artifacts`), each graph class's
precompiled layer step (`graph-<class>.bin`, kiln/compile/precompiled.py) and a manifest naming each file
with its size and sha256. Inductor's and Triton's own caches live under the same root.
Entries are written into a temporary folder and renamed into place while holding a per-key file lock,
so a reader never sees half an entry and two processes warming one key take turns."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from kiln.paths import cache_root
from kiln.version import VERSION

log = logging.getLogger(__name__)

ARTIFACTS = "artifacts.bin"
MANIFEST = "manifest.json"
GRAPH = "graph-{}.bin"
# Build caches an export carries besides torch's artifacts, by folder and the files taken: FlashInfer's JIT
# modules (with ninja's logs, so a machine with the same paths finds them up to date), Triton's kernels,
# kiln's CPU kernels, and the libraries Inductor compiled its C++ kernels into (the artifacts hold only
# their source; each is found by a hash of its source and compile command, so a machine with another
# compiler or vector ISA builds its own).
_BUILDS = {"flashinfer": "*", "triton": "*", "cpu-kernels": "*", "inductor": "*.so"}


class CacheError(RuntimeError):
    pass


def point_caches(root: Path) -> None:
    """Inductor, Triton and FlashInfer keep their build caches under kiln's root. Inductor and Triton read
    these variables on each use; FlashInfer reads its own once, on import, so the engine calls this first."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(root / "flashinfer")  # JIT builds land in .cache/flashinfer
    os.environ["TVM_FFI_CACHE_DIR"] = str(root / "tvm-ffi")  # FlashInfer's FFI may build a torch add-on


def environment() -> dict[str, str | None]:
    """The software a compiled graph depends on besides the model: kiln's own source, and its toolchain."""
    return {
        "kiln": VERSION,
        "kiln_source": source_hash(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": platform.python_version(),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def source_hash(root: Path = Path(__file__).parents[1]) -> str:
    """Every kiln source file, recursively: model code, ops, Triton and C++ kernels and the lowering all end
    up in compiled graphs, and hashing the whole package leaves no folder to forget."""
    h = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class CompileCache:
    def __init__(self, parts: dict[str, Any], root: Path | None = None) -> None:
        self.root = root or cache_root()
        self.parts = parts
        self.key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
        self.dir = self.root / "compile" / self.key
        point_caches(self.root)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Held while warming this key; a second process waits here, then finds the finished entry."""
        path = self.root / "compile" / f"{self.key}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def check(self) -> str | None:
        """None for a complete entry; otherwise why it cannot be used."""
        try:
            manifest = json.loads((self.dir / MANIFEST).read_text())
            files = manifest["files"]
            if manifest.get("key") != self.key or ARTIFACTS not in files:
                return "its manifest does not match its key"
            for name, meta in files.items():
                path = self.dir / name
                if not path.is_file() or path.stat().st_size != meta["size"]:
                    return f"{name} is missing or truncated"
                if _sha256(path) != meta["sha256"]:
                    return f"{name} does not match its checksum"
        except FileNotFoundError:
            return "missing"
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"unreadable manifest ({e})"
        return None

    def load(self) -> bool:
        """Hot-loads a complete entry into torch's caches. A partial or corrupt one is removed (with a
        warning) so the caller rebuilds it. Call with the lock held."""
        problem = self.check()
        if problem == "missing":
            return False
        if problem is None:
            try:
                torch.compiler.load_cache_artifacts((self.dir / ARTIFACTS).read_bytes())
                return True
            except Exception as e:  # torch raises its own types for undecodable artifacts
                problem = f"torch could not load its artifacts ({e})"
        log.warning("compile cache entry %s is unusable: %s; rebuilding it", self.dir, problem)
        shutil.rmtree(self.dir, ignore_errors=True)
        return False

    def graphs(self) -> dict[str, bytes]:
        """A loaded entry's precompiled graphs, by graph class."""
        files = json.loads((self.dir / MANIFEST).read_text())["files"]
        prefix, suffix = GRAPH.split("{}")
        return {
            name[len(prefix) : -len(suffix)]: (self.dir / name).read_bytes()
            for name in files
            if name.startswith(prefix) and name.endswith(suffix)
        }

    def save(self, report: list[dict[str, Any]], graphs: dict[str, bytes]) -> None:
        """Writes this process's compile artifacts and the precompiled graphs as the entry, atomically.
        Call with the lock held. Nothing to save only costs the next start its compile time, so it warns
        rather than fails."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            log.warning("torch recorded no compile artifacts: compile cache entry %s not written", self.key)
            return
        self._install({ARTIFACTS: saved[0]} | {GRAPH.format(n): data for n, data in graphs.items()}, report)

    def _install(self, blobs: dict[str, bytes], report: list[dict[str, Any]]) -> None:
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.key}-", dir=self.dir.parent))
        try:
            files = {}
            for name, data in blobs.items():
                (staging / name).write_bytes(data)
                files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            manifest = {"key": self.key, "parts": self.parts, "files": files, "buckets": report}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
            shutil.rmtree(self.dir, ignore_errors=True)
            os.rename(staging, self.dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def export(self, dest: Path) -> None:
        """One portable file: the entry's manifest and artifacts, and the root's build caches, zipped."""
        problem = self.check()
        if problem is not None:
            raise CacheError(f"no complete compile cache entry to export ({problem}); run kiln warmup first")
        tmp = dest.with_name(dest.name + ".tmp")
        with zipfile.ZipFile(tmp, "w") as z:
            z.write(self.dir / MANIFEST, MANIFEST)
            for name in json.loads((self.dir / MANIFEST).read_text())["files"]:
                z.write(self.dir / name, name)
            for build, pattern in _BUILDS.items():
                for path in sorted((self.root / build).rglob(pattern)):
                    if path.is_file() and not path.is_symlink():
                        z.write(path, path.relative_to(self.root).as_posix())
        os.replace(tmp, dest)

    def import_file(self, src: Path) -> None:
        """Installs an exported file as this key's entry, after checking it was built for the same key.
        Its build caches were unpacked before anything was built (import_builds)."""
        with _open_export(src) as (z, manifest):
            if manifest.get("key") != self.key:
                theirs = manifest.get("parts", {})
                diff = sorted(k for k in set(theirs) | set(self.parts) if theirs.get(k) != self.parts.get(k))
                raise CacheError(f"{src} was built for a different setup (differs in: {', '.join(diff)})")
            blobs = {name: z.read(name) for name in manifest["files"]}
            for name, data in blobs.items():
                if hashlib.sha256(data).hexdigest() != manifest["files"][name]["sha256"]:
                    raise CacheError(f"{src}: {name} does not match its checksum")
            with self.lock():
                self._install(blobs, manifest.get("buckets", []))


@contextlib.contextmanager
def _open_export(src: Path) -> Iterator[tuple[zipfile.ZipFile, dict[str, Any]]]:
    try:
        z = zipfile.ZipFile(src)
        manifest = json.loads(z.read(MANIFEST))
        missing = set(manifest["files"]) - set(z.namelist())
    except FileNotFoundError:
        raise CacheError(f"{src}: no such file") from None
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError) as e:
        raise CacheError(f"{src}: not a kiln compile cache export ({e})") from None
    with z:
        if missing:
            raise CacheError(f"{src}: not a kiln compile cache export (no {', '.join(sorted(missing))})")
        try:
            yield z, manifest
        except zipfile.BadZipFile as e:  # a member's CRC, found on reading it
            raise CacheError(f"{src} is damaged ({e})") from None


def import_builds(src: Path, root: Path) -> None:
    """Writes an export's build caches (FlashInfer's modules, Triton's kernels, kiln's CPU kernels,
    Inductor's C++ libraries) under the root with their recorded times: ninja rebuilds whatever looks older
    than its sources. The engine calls this before it builds any kernel, which would otherwise be built
    again here and only then replaced. Each file is renamed into place: a library this process has loaded
    already (kiln's CPU kernels, for a second engine in one process) keeps its own copy, where writing over
    it would crash."""
    root = root.resolve()
    with _open_export(src) as (z, _):
        for info in z.infolist():
            if info.is_dir() or info.filename.split("/")[0] not in _BUILDS:
                continue
            dest = (root / info.filename).resolve()
            if not dest.is_relative_to(root):
                raise CacheError(f"an export's file {info.filename!r} would land outside {root}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".unpack-")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(z.read(info))
                stamp = datetime.datetime(*info.date_time).timestamp()
                os.utime(tmp, (stamp, stamp))
                os.replace(tmp, dest)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
