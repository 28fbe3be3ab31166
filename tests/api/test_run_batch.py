"""`kiln run-batch` (vLLM's run-batch): an OpenAI batch file run as a real process with the server's own
config, its results written through an HTTP PUT, each line the same reply the server gives (or its error),
in the input's order; and input that cannot run is a CLI error naming the file and line."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import yaml

from kiln.cli import main
from tests.api.server import Server, free_port, post
from tests.conftest import SERVE_CONFIG

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12, "temperature": 0}  # fmt: skip
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
MESSAGE = {"model": MODEL, "messages": CHAT["messages"], "max_tokens": 12, "temperature": 0}


class _Store(http.server.BaseHTTPRequestHandler):
    """GET serves `files`; PUT stores the body there."""

    files: ClassVar[dict[str, bytes]] = {}

    def do_GET(self) -> None:
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:
        self.files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(201)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def run_batch(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    config = tmp / "serve.yaml"
    config.write_text(yaml.safe_dump(SERVE_CONFIG))
    cmd = [sys.executable, "-m", "kiln", "run-batch", "--config", str(config), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def line(custom_id: str, url: str, body: dict[str, Any], method: str = "POST") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def test_a_batch_gives_each_line_the_servers_reply(server: Server, store: str, tmp_path: Path) -> None:
    lines = [
        line("chat", "/v1/chat/completions", CHAT),
        line("completion", "/v1/completions", COMPLETION),
        line("message", "/v1/messages", MESSAGE),
        line("bad-n", "/v1/chat/completions", {**CHAT, "n": 0}),
        line("no-model", "/v1/completions", {**COMPLETION, "model": "x"}),
        line("stream", "/v1/chat/completions", {**CHAT, "stream": True}),
        line("url", "/v1/moderations", {}),
        line("get", "/v1/models", {}, method="GET"),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    done = run_batch(tmp_path, "-i", str(source), "-o", f"{store}/out.jsonl")
    assert done.returncode == 0, done.stderr
    assert "kiln is ready in-process" in done.stderr and "Running batch" in done.stderr
    results = [json.loads(line) for line in _Store.files["/out.jsonl"].decode().splitlines()]
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]
    assert [r["response"]["status_code"] for r in results] == [200, 200, 200, 400, 404, 400, 400, 400]
    for r in results:
        assert set(r) == {"id", "custom_id", "response", "error"} and r["id"].startswith("kiln-")
        assert set(r["response"]) == {"status_code", "request_id", "body"}
        assert (r["error"] is None) == (r["response"]["status_code"] == 200)
        assert r["error"] is None or r["error"] == r["response"]["body"]  # vLLM's place and OpenAI's
    chat, completion, message = (r["response"]["body"] for r in results[:3])
    served = post(server, "/v1/chat/completions", json=CHAT).json()
    assert chat["choices"][0]["message"] == served["choices"][0]["message"]
    served = post(server, "/v1/completions", json=COMPLETION).json()
    assert completion["choices"][0]["text"] == served["choices"][0]["text"]
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    errors = [r["error"]["error"] for r in results[3:]]
    assert [(e["type"], e["param"]) for e in errors] == [
        ("BadRequestError", "n"), ("NotFoundError", "model"), ("BadRequestError", "stream"),
        ("BadRequestError", "url"), ("BadRequestError", "method"),
    ]  # fmt: skip
    assert errors[2]["message"] == "Request must not be sent in stream mode"  # vLLM's


@pytest.mark.parametrize(
    "text, says",
    [
        (json.dumps(line("a", "/v1/completions", {})) + "\nnot json\n", "line 2: "),
        ('{"custom_id": "a", "method": "POST", "url": "/v1"}', "line 1: Object missing required field"),
        ("\n\n", "holds no requests"),
    ],
)  # fmt: skip
def test_input_that_cannot_run_is_a_cli_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, text: str, says: str
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(text)
    code, err = run_batch_here(tmp_path, capsys, "-i", str(source), "-o", str(tmp_path / "out.jsonl"))
    assert code == 1 and f"kiln run-batch: error: {source}" in err and says in err
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_input_is_named(tmp_path: Path, capsys: pytest.CaptureFixture, store: str) -> None:
    for source, says in ((str(tmp_path / "none.jsonl"), "cannot read"), (f"{store}/none.jsonl", "HTTP 404")):
        code, err = run_batch_here(tmp_path, capsys, "-i", source, "-o", str(tmp_path / "out.jsonl"))
        assert code == 1 and says in err and source in err


def run_batch_here(tmp: Path, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """kiln run-batch in this process (for input refused before anything loads): its status and stderr."""
    config = tmp / "serve.yaml"
    config.write_text(yaml.safe_dump(SERVE_CONFIG))
    code = main(["run-batch", "--config", str(config), *args])
    return code, capsys.readouterr().err


def test_metrics_while_a_batch_runs(tmp_path: Path) -> None:
    """--enable-metrics: the engine's Prometheus metrics on --host and --port while the batch runs."""
    source = tmp_path / "in.jsonl"
    long = {**COMPLETION, "max_tokens": 300, "ignore_eos": True}
    source.write_text(json.dumps(line("long", "/v1/completions", long)))
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(SERVE_CONFIG))
    port = free_port()
    cmd = [sys.executable, "-m", "kiln", "run-batch", "--config", str(config), "-i", str(source)]
    cmd += ["-o", str(tmp_path / "out.jsonl"), "--enable-metrics", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    running = None
    while proc.poll() is None and running is None:
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        running = re.search(r"^kiln:num_requests_running\{[^}]*\} 1\.0$", text, re.M)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and running is not None, err
    result = json.loads((tmp_path / "out.jsonl").read_text())
    assert result["response"]["body"]["usage"]["completion_tokens"] == 300
