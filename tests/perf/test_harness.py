"""`kiln perf` end to end: a tiny sweep against real kiln servers, its JSON, CSV, charts and comparison."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from kiln.cli import main
from tests.api.server import Server, free_port
from tests.conftest import API_KEY
from tests.models import tiny

SMOKE = Path(__file__).parent.parent.parent / "configs" / "perf" / "smoke.yaml"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_run_plot_compare(server: Server, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["perf", "run", "--spec", str(SMOKE), "--base-url", server.url, "--model", MODEL]
    assert main([*args, "--api-key", API_KEY, "--label", "kiln", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kiln-smoke.json").read_text())
    assert result["label"] == "kiln" and result["spec"]["name"] == "smoke"
    assert result["target"]["model"] == MODEL and "version" in result["target"]["version"]
    assert result["client"]["cpus"] >= 1
    assert [p["concurrency"] for p in result["points"]] == [1, 4]
    for point in result["points"]:
        s = point["summary"]
        assert (s["completed"], s["failed"], s["errors"]) == (4, 0, [])
        assert (s["total_input_tokens"], s["total_output_tokens"]) == (4 * 16, 4 * 8)  # exact lengths
        assert 0 < s["ttft_ms"]["median"] <= s["e2el_ms"]["median"]
        assert s["tpot_ms"]["mean"] > 0 and s["goodput"] is not None
    rows = list(csv.DictReader((tmp_path / "kiln-smoke.csv").open()))
    assert [r["concurrency"] for r in rows] == ["1", "4"]
    assert float(rows[1]["output_throughput"]) == pytest.approx(
        result["points"][1]["summary"]["output_throughput"]
    )
    assert {"ttft_ms_p99", "tpot_ms_median", "itl_ms_p90", "e2el_ms_mean", "goodput"} <= set(rows[0])

    assert main(["perf", "plot", str(tmp_path / "kiln-smoke.json"), "--out", str(tmp_path)]) == 0
    for name in ("throughput.png", "latency.png", "per_user.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name

    capsys.readouterr()
    assert (
        main(["perf", "compare", str(tmp_path / "kiln-smoke.json"), str(tmp_path / "kiln-smoke.json")]) == 0
    )
    table = capsys.readouterr().out
    assert "input 16, output 8, concurrency 4" in table
    assert "output_throughput" in table and table.count("    1.00") >= 10


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chat", "messages"])
def test_chat_and_messages_modes(server: Server, tmp_path: Path, mode: str) -> None:
    """The builtin prompts as one user message each, streamed from /v1/chat/completions (ignore_eos: every
    reply is max_tokens long) or /v1/messages (replies end where the model ends them)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SMOKE.read_text().replace("dataset: random", f"dataset: builtin\nmode: {mode}"))
    args = ["perf", "run", "--spec", str(spec), "--base-url", server.url, "--model", MODEL, "--label", mode]
    assert main([*args, "--api-key", API_KEY, "--out", str(tmp_path)]) == 0
    for point in json.loads((tmp_path / f"{mode}-smoke.json").read_text())["points"]:
        s = point["summary"]
        assert (s["completed"], s["failed"]) == (4, 0)
        assert s["total_input_tokens"] > 4 * 16  # the prompts' own tokens and the template's
        assert 4 <= s["total_output_tokens"] <= 4 * 8 and (
            mode == "messages" or s["total_output_tokens"] == 32
        )
        assert 0 < s["ttft_ms"]["median"] <= s["e2el_ms"]["median"]


def test_bad_key_is_counted_not_dropped(server: Server, tmp_path: Path) -> None:
    args = [
        "perf",
        "run",
        "--spec",
        str(SMOKE),
        "--base-url",
        server.url,
        "--model",
        MODEL,
        "--out",
        str(tmp_path),
    ]
    assert main([*args, "--api-key", "wrong", "--label", "nokey"]) == 1
    point = json.loads((tmp_path / "nokey-smoke.json").read_text())["points"][0]["summary"]
    assert (point["completed"], point["failed"]) == (0, 4)
    assert point["errors"][0].startswith("HTTP 401: ")


def test_offline_mode(tmp_path: Path) -> None:
    tiny.build("llama", tmp_path / "model")
    args = ["perf", "run", "--offline", "--model", str(tmp_path / "model"), "--spec", str(SMOKE)]
    assert main([*args, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "offline-smoke.json").read_text())
    assert result["target"]["offline"] is True
    for point in result["points"]:
        s = point["summary"]
        assert (s["completed"], s["total_input_tokens"], s["total_output_tokens"]) == (4, 64, 32)
        assert s["ttft_ms"]["median"] > 0 and s["itl_ms"]["median"] > 0


def test_serve_sweep_runs_each_server(tmp_path: Path) -> None:
    tiny.build("llama", tmp_path / "model")
    servers = []
    for name, seqs in (("kiln-1seq", 1), ("kiln-4seq", 4)):
        port = free_port()
        command = (
            f"{sys.executable} -m kiln serve --model {tmp_path / 'model'} --port {port} "
            f"--max-num-seqs {seqs} --kv-cache-gib 0.01 --enforce-eager"  # the harness is tested, not compile
        )
        servers.append(
            {"name": name, "command": command, "base_url": f"http://127.0.0.1:{port}", "model": "m"}
        )
        servers[-1]["command"] += " --served-model-name m"
    (tmp_path / "servers.yaml").write_text(json.dumps({"servers": servers}))
    spec = tmp_path / "smoke.yaml"
    spec.write_text(SMOKE.read_text() + "token_id_range: [0, 200]  # the tiny model's vocabulary\n")
    out = tmp_path / "out"
    args = ["perf", "serve-sweep", "--servers", str(tmp_path / "servers.yaml"), "--spec", str(spec)]
    assert main([*args, "--out", str(out), "--plot"]) == 0
    for name in ("kiln-1seq", "kiln-4seq"):
        result = json.loads((out / f"{name}-smoke.json").read_text())
        assert [p["summary"]["completed"] for p in result["points"]] == [4, 4]
        assert result["target"]["ready_s"] > 0
        memory = result["target"]["memory"]  # the server's own process tree: more than a Python, torch loaded
        assert 200 < memory["pss_mib"] <= memory["peak_rss_sum_mib"]
        assert "kiln is ready" in (out / f"{name}.log").read_text()
    comparison = (out / "comparison-smoke.txt").read_text()
    assert comparison.startswith("# kiln-1seq vs kiln-4seq")
    assert (out / "throughput.png").read_bytes().startswith(PNG)
