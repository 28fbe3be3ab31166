import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (on CPU tensors). It is read when a kernel is
# defined, so it is set before any test imports kiln.ops.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A key in the caller's environment would guard every test server that sets none (vLLM's fallback).
os.environ.pop("VLLM_API_KEY", None)

from tests.api.server import API_KEY, Server, start_server

# What the fuzz suite sent and what came back, printed at the end of the run.
FUZZ_REPORT = pytest.StashKey[list[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-examples", type=int, default=None, help="examples for tests/api/test_fuzz.py")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash.get(FUZZ_REPORT, [])
    if lines:
        terminalreporter.section("fuzz")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model as a Hugging Face folder (converted once, then reused from the kiln cache)."""
    from kiln.models.convert import default_model_dir

    return default_model_dir()


MAX_MODEL_LEN = 512
SECOND_KEY = "second-key"  # tiny_server takes two API keys
TINY_NAME = "tiny"  # and two names, "tiny" first
ALLOWED_ORIGIN = "https://ui.example"  # and browsers on this origin (CORS)
MAX_REQUEST_BYTES = 65536

# The default model with small limits, so that "too long" and "too large" are cheap to reach. Its dtype is
# pinned: some tests assert what the model replies, and `auto` depends on the CPU (bfloat16 where the CPU
# multiplies it natively), so every machine serves the same tokens.
SERVE_CONFIG = {
    "model": {"model": "default", "max_model_len": MAX_MODEL_LEN, "dtype": "float16"},
    "cache": {"kv_cache_gib": 0.25},
    "scheduler": {"max_num_seqs": 64},
    "server": {"api_key": API_KEY, "max_request_bytes": MAX_REQUEST_BYTES, "drain_timeout": 60},
}


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("serve"), SERVE_CONFIG)
    yield srv
    assert srv.stop() == 0, srv.output()


# A tiny random model with the default tokenizer, eager, with low per-request limits: for the hostile-input
# tests and the fuzz suite, where what matters is the API and the model's speed does not.
TINY_MAX_MODEL_LEN = 256
TINY_LIMITS = {"max_n_sequences": 4, "max_completion_prompts": 4, "max_prompt_chars": 12_000_000}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    from tests.models.tiny import build_default_vocab

    return build_default_vocab(tmp_path_factory.mktemp("tiny-default-vocab"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Server]:
    config = {
        "model": {
            "model": str(tiny_model_dir),
            "max_model_len": TINY_MAX_MODEL_LEN,
            "reasoning_parser": "qwen3",
            "enable_prompt_embeds": True,
        },
        "cache": {"kv_cache_gib": 0.0625},
        "scheduler": {"max_num_seqs": 16, "policy": "priority"},
        "compile": {"mode": "eager"},
        # tool_choice "auto" read as hermes, thinking as qwen3: their tests force the text by a constraint.
        "server": {
            "served_model_name": [TINY_NAME, "tiny-alias"],
            "api_key": [API_KEY, SECOND_KEY],
            "allowed_origins": [ALLOWED_ORIGIN],
            "disable_access_log_for_endpoints": ["/health", "/metrics"],
            "enable_auto_tool_choice": True,
            "tool_call_parser": "hermes",
            "enable_request_id_headers": True,
            "enable_prompt_tokens_details": True,
            "enable_log_requests": True,
            "enable_log_outputs": True,
            "max_log_len": 5,
            "log_stats_interval": 0.5,
            **TINY_LIMITS,
        },
    }
    srv = start_server(tmp_path_factory.mktemp("serve-tiny"), config)
    yield srv
    assert srv.stop() == 0, srv.output()
