"""The compile cache across real processes: `kiln warmup` and `kiln serve` on a tiny model, each run with
its own KILN_CACHE_DIR. Whether a graph was traced and compiled is read from torch's own counters."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from openai import OpenAI

import kiln
from kiln import LLM, SamplingParams
from kiln.compile.cache import CacheError, environment, import_builds, source_hash
from kiln.ops.cpu import native
from kiln.paths import cache_root
from tests.api.server import start_server
from tests.compile import start
from tests.models.tiny import build

MODE = ["--compile-mode", "compiled"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    build("llama", path)
    return path


def seeded(cache: Path) -> Path:
    """A new cache root that already holds this session's build of kiln's CPU kernels. Each process here
    would otherwise build them again into its empty root (about 20 s), which is not what these tests are
    about; the export and import of a build are (a FlashInfer one, below)."""
    native.load()
    built = native.folder()
    shutil.copytree(built, cache / built.relative_to(cache_root()))
    return cache


def warmup(model: Path, cache: Path, out: Path, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kiln", "warmup", "--model", str(model), *MODE, "--no-progress"]
    env = {**os.environ, "KILN_CACHE_DIR": str(cache)}
    return subprocess.Popen(
        [*cmd, "--json", str(out), *flags],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen) -> str:
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output
    return output


def entries(cache: Path) -> list[Path]:
    return [p for p in (cache / "compile").iterdir() if p.is_dir() and not p.name.startswith(".")]


# A FlashInfer JIT build (a GPU machine makes these), under a cache root.
FLASHINFER_BUILD = Path("flashinfer", ".cache", "flashinfer", "0.5.3", "90a", "cached_ops", "m", "m.so")


@pytest.fixture(scope="module")
def first_start(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache after one cold `kiln warmup --export` (first.json, tiny.kiln-cache beside it), which holds a
    FlashInfer build too. Each test copies it: a cold warmup is the slowest part of these tests."""
    folder = tmp_path_factory.mktemp("first-start")
    cache = seeded(folder / "cache")
    built = cache / FLASHINFER_BUILD
    built.parent.mkdir(parents=True)
    built.write_bytes(b"\x7fELF module")
    os.utime(built, (1_700_000_000, 1_700_000_000))
    finish(warmup(tiny, cache, folder / "first.json", "--export", str(folder / "tiny.kiln-cache")))
    return folder


def test_second_start_recompiles_nothing_and_an_export_loads_elsewhere(
    tiny: Path, first_start: Path, tmp_path: Path
) -> None:
    shutil.copytree(first_start, tmp_path, dirs_exist_ok=True)
    cache, exported = tmp_path / "cache", tmp_path / "tiny.kiln-cache"
    built = cache / FLASHINFER_BUILD  # the export carries it, with its time
    first = json.loads((tmp_path / "first.json").read_text())
    # Two graph classes (decode of one, of more); with the CPU attention op mixed steps run the decode graph.
    assert first["counters"]["dynamo_graphs"] == 2
    assert first["counters"]["autograd_cache_miss"] == 2
    assert [b["source"] for b in first["buckets"]] == ["compiled", "compiled", "shared"]
    [entry] = entries(cache)
    assert sorted(p.name for p in entry.iterdir()) == [
        "artifacts.bin", "graph-decode-1.bin", "graph-decode.bin", "manifest.json"
    ]  # fmt: skip

    # The second start loads each graph class as traced: dynamo traces nothing, Inductor compiles nothing.
    output = finish(warmup(tiny, cache, tmp_path / "second.json"))
    second = json.loads((tmp_path / "second.json").read_text())
    assert set(second["counters"].values()) == {0}
    assert [b["source"] for b in second["buckets"]] == ["precompiled", "precompiled", "shared"]
    assert "decode-1" in output and "total" in output

    # Another machine with the same versions: an empty cache root and the exported file. The export's
    # builds land before the engine needs one: kiln's CPU kernels load from it, not built again.
    output = finish(warmup(tiny, tmp_path / "elsewhere", tmp_path / "third.json", "--import", str(exported)))
    assert "building kiln's CPU kernels" not in output
    kernels = native.folder().relative_to(cache_root()) / "kernels.so"
    assert (tmp_path / "elsewhere" / kernels).read_bytes() == (cache / kernels).read_bytes()
    # Nor does Inductor compile its C++ kernels again: it finds the export's libraries, named by their hash.
    libraries = {p.relative_to(cache): p.stat().st_mtime for p in (cache / "inductor").rglob("*.so")}
    there = {
        p.relative_to(tmp_path / "elsewhere"): p.stat().st_mtime
        for p in (tmp_path / "elsewhere" / "inductor").rglob("*.so")
    }
    # The two graph classes' libraries; on an AVX-512 CPU also Inductor's ISA probes (avx512_bf16, vnni).
    assert sum(p.name.endswith(".main.so") for p in libraries) == 2 and there.keys() == libraries.keys()
    assert all(abs(there[p] - libraries[p]) <= 2 for p in libraries)  # the export's files, not new builds
    third = json.loads((tmp_path / "third.json").read_text())
    assert set(third["counters"].values()) == {0}
    assert [b["source"] for b in third["buckets"]] == ["precompiled", "precompiled", "shared"]
    landed = tmp_path / "elsewhere" / built.relative_to(cache)
    assert landed.read_bytes() == built.read_bytes()
    assert abs(landed.stat().st_mtime - 1_700_000_000) <= 2  # zip keeps times to 2 s


@pytest.mark.parametrize(
    ("arch", "attention", "classes"),
    [
        # (A dense Llama's classes with the CPU attention: test_second_start_recompiles_nothing_...)
        # The torch attention traces decode steps apart, so mixed steps get a graph of their own.
        ("llama", "torch", ["decode", "decode-1", "mixed"]),
        # A MoE layer and a dense one: each group (one layer here) has its kind's graph.
        ("qwen3_moe", "cpu", ["decode-1.0", "decode-1.1", "decode.0", "decode.1"]),
    ],
)
def test_a_precompiled_start_traces_nothing_and_generates_what_the_first_did(
    arch: str, attention: str, classes: list[str], tmp_path: Path
) -> None:
    build(arch, tmp_path / "model")
    cache, model = seeded(tmp_path / "cache"), tmp_path / "model"
    options = {"mode": "compiled", "attention": attention, "kv_cache_gib": 0.01, "max_num_seqs": 8}
    cold = start.run(model, cache, **options)
    warm = start.run(model, cache, **options)
    assert sorted(cold["graphs"]) == sorted(warm["graphs"]) == classes
    assert set(cold["graphs"].values()) == {"traced"} and set(warm["graphs"].values()) == {"loaded"}
    # The torch attention also compiles its own paged decode (for mixed steps' decode rows) with plain
    # torch.compile: each process traces that again (Inductor's cache has its code), and only that.
    nested = cold["counters"]["dynamo_graphs"] - len(classes)
    assert warm["counters"]["dynamo_graphs"] <= nested and (nested == 0) == (attention == "cpu")
    assert warm["counters"]["fxgraph_cache_miss"] == warm["counters"]["autograd_cache_miss"] == 0
    eager = start.generate(LLM(str(model), **(options | {"mode": "eager"})))  # compiles nothing: in process
    assert warm["tokens"] == cold["tokens"] == eager


def test_import_of_a_foreign_file_names_it(tiny: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.zip"
    bad.write_bytes(b"not a zip")
    proc = warmup(tiny, seeded(tmp_path / "c"), tmp_path / "c.json", "--import", str(bad))
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 1
    assert f"{bad}: not a kiln compile cache export" in output


def test_two_concurrent_warmups_of_one_key(tiny: Path, tmp_path: Path) -> None:
    cache = seeded(tmp_path / "cache")
    procs = [warmup(tiny, cache, tmp_path / f"{i}.json") for i in range(2)]
    for proc in procs:
        finish(proc)
    sources = []
    for i in range(2):
        [source] = {b["source"] for b in json.loads((tmp_path / f"{i}.json").read_text())["buckets"]} - {
            "shared"
        }
        sources.append(source)
    # The lock makes them take turns: one compiles, the other loads the finished entry.
    assert sorted(sources) == ["compiled", "precompiled"]
    [entry] = entries(cache)
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["key"] == entry.name and "artifacts.bin" in manifest["files"]


def test_corrupt_entry_is_rebuilt_and_the_server_answers(
    tiny: Path, first_start: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(first_start / "cache", cache)
    [entry] = entries(cache)
    artifacts = entry / "artifacts.bin"
    data = bytearray(artifacts.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifacts.write_bytes(bytes(data))

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(str(tiny), mode="eager", kv_cache_gib=0.01).generate(["t1 t2 t3"], params, use_tqdm=False)

    config = {"model": {"model": str(tiny)}, "cache": {"kv_cache_gib": 0.01}, "compile": {"mode": "compiled"}}
    server = start_server(tmp_path, config, env={"KILN_CACHE_DIR": str(cache)})
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        out = client.completions.create(model=str(tiny), prompt="t1 t2 t3", max_tokens=8, temperature=0)
        assert out.choices[0].text == expected[0].outputs[0].text
    finally:
        server.stop()
    log = server.output()
    assert "artifacts.bin does not match its checksum; rebuilding it" in log
    manifest = json.loads((entry / "manifest.json").read_text())
    rebuilt = (entry / "artifacts.bin").read_bytes()
    assert len(rebuilt) == manifest["files"]["artifacts.bin"]["size"]


@pytest.mark.parametrize(
    "source", ["models/decoder.py", "ops/attention.py", "ops/triton/norm.py", "compile/lowering.py", "new"]
)
def test_cache_key_changes_with_any_kiln_source(source: str, tmp_path: Path) -> None:
    """The key hashes every kiln source, recursively: an edited Triton kernel is a different entry."""
    root = tmp_path / "kiln"
    shutil.copytree(Path(kiln.__file__).parent, root, ignore=shutil.ignore_patterns("__pycache__"))
    assert environment()["kiln_source"] == source_hash() == source_hash(root)
    if source == "new":
        (root / "ops" / "triton" / "fused.py").write_text("X = 1\n")
    else:
        with (root / source).open("a") as f:
            f.write("# an edit\n")
    assert source_hash(root) != source_hash()


def export_file(path: Path, builds: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:  # stored, so a member's bytes can be flipped in place
        z.writestr("manifest.json", json.dumps({"key": "k", "files": {}}))
        for name, data in builds.items():
            z.writestr(name, data)
    return path


def test_an_export_whose_build_is_damaged_or_escapes_the_root_is_refused(tmp_path: Path) -> None:
    damaged = export_file(tmp_path / "damaged.kiln-cache", {"triton/k/k.cubin": b"cubin" * 100})
    data = bytearray(damaged.read_bytes())
    data[data.rindex(b"cubincubin") + 3] ^= 0xFF  # in the data, past the header's name
    damaged.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=re.escape(f"{damaged} is damaged (Bad CRC-32")):
        import_builds(damaged, tmp_path / "root")
    assert not list((tmp_path / "root").rglob("k.cubin"))  # nor any half-written file under another name
    assert [p.name for p in (tmp_path / "root" / "triton" / "k").iterdir()] == []

    escaping = export_file(tmp_path / "escaping.kiln-cache", {"triton/../../evil.so": b"x"})
    with pytest.raises(CacheError, match=re.escape("'triton/../../evil.so' would land outside")):
        import_builds(escaping, tmp_path / "root")
    assert not (tmp_path / "evil.so").exists()
