"""LoRA adapters through a real `kiln serve` and the OpenAI client: --lora-modules, a request's `model`
naming an adapter (checked against transformers with the adapter merged), /v1/models, and vLLM's runtime
load and unload endpoints with their errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from tests.api.server import AUTH, Server, expect_error, post, start_server
from tests.conftest import API_KEY
from tests.models.lora_adapters import merged, save_adapter
from tests.models.tiny import build_default_vocab

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
BASE = "tiny-base"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> dict[str, Path]:
    model = build_default_vocab(tmp_path_factory.mktemp("tiny-lora"), default_model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    root = tmp_path_factory.mktemp("adapters")
    return {
        "model": model,
        "sql": save_adapter(root / "sql", hf, seed=1, rank=8, alpha=32.0),
        "chat": save_adapter(root / "chat", hf, seed=2, rank=4, modules=("q_proj", "v_proj", "down_proj")),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, folders: dict[str, Path]) -> Iterator[Server]:
    config = {
        "model": {"model": str(folders["model"]), "max_model_len": 512, "dtype": "float32"},
        "cache": {"kv_cache_gib": 0.05},
        "compile": {"mode": "eager"},
        "server": {"api_key": API_KEY, "served_model_name": BASE},
    }
    flags = [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"sql={folders['sql']}",
    ]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    srv = start_server(tmp_path_factory.mktemp("serve-lora"), config, *flags, env=env)
    yield srv
    assert srv.stop() == 0, srv.output()


def _hf(folders: dict[str, Path]) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folders["model"], dtype=torch.float32).eval()


def _reference(folders: dict[str, Path], adapter: str | None) -> str:
    """transformers' greedy 8 tokens after PROMPT, with the adapter merged into the weights."""
    tok = transformers.AutoTokenizer.from_pretrained(folders["model"])
    hf = _hf(folders)
    model = hf if adapter is None else merged(hf, folders[adapter])
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1] :])


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model
    return out.choices[0].text


def test_served_adapters_answer_under_their_names(server: Server, folders: dict[str, Path]) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == [BASE, "sql"]
    assert (models["sql"].root, models["sql"].parent) == (str(folders["sql"]), BASE)  # type: ignore[attr-defined]
    base, sql = _complete(client, BASE), _complete(client, "sql")
    assert base == _reference(folders, None)
    assert sql == _reference(folders, "sql") != base
    with pytest.raises(openai.NotFoundError, match=r"The model `chat` does not exist\."):
        _complete(client, "chat")


def test_lora_requests_info_names_the_running_adapters(server: Server) -> None:
    def info() -> str:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return next(line for line in text.splitlines() if line.startswith("kiln:lora_requests_info{"))

    assert info().startswith(
        'kiln:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
    )
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    seen = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        for _ in zip(range(20), r.iter_lines(), strict=False):  # while its first tokens come, it runs
            seen.append(info())
    assert any('running_lora_adapters="sql"' in line for line in seen), seen


def test_runtime_load_and_unload(server: Server, folders: dict[str, Path]) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)

    def load(name: str, path: object, **extra: object) -> httpx.Response:
        return post(
            server, "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra}
        )

    def unload(**body: object) -> httpx.Response:
        return post(server, "/v1/unload_lora_adapter", json=body)

    loaded = load("chat", folders["chat"])
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'chat' added successfully.")
    assert [m.id for m in client.models.list().data] == [BASE, "sql", "chat"]
    assert _complete(client, "chat") == _reference(folders, "chat")

    assert expect_error(load("chat", folders["chat"]), 400, "InvalidUserInput") == (
        "The lora adapter 'chat' has already been loaded. If you want to load the adapter in place, set "
        "'load_inplace' to True."
    )
    assert load("chat", folders["chat"], load_inplace=True).status_code == 200  # the same, read again
    assert _complete(client, "chat") == _reference(folders, "chat")
    missing = post(server, "/v1/load_lora_adapter", json={"lora_name": "x"})
    assert (
        expect_error(missing, 400, "InvalidUserInput") == "Both 'lora_name' and 'lora_path' must be provided."
    )
    assert expect_error(load(BASE, folders["chat"]), 400, "InvalidUserInput") == (
        f"The lora adapter '{BASE}' conflicts with a served base model."
    )
    nowhere = folders["model"] / "nowhere"
    assert expect_error(load("x", nowhere), 404, "NotFoundError") == (
        f"Loading lora x failed: No adapter found for {nowhere}"
    )
    wide = save_adapter(folders["model"].parent / "wide", _hf(folders), seed=3, rank=16)
    message = expect_error(load("x", wide), 400, "BadRequestError")
    assert message == "LoRA adapter 'x': LoRA rank 16 is greater than max_lora_rank 8"
    assert [m.id for m in client.models.list().data] == [BASE, "sql", "chat"]

    unloaded = unload(lora_name="chat")
    assert (unloaded.status_code, unloaded.text) == (
        200,
        "Success: LoRA adapter 'chat' removed successfully.",
    )
    gone = expect_error(unload(lora_name="chat"), 404, "NotFoundError")
    assert gone == "The lora adapter 'chat' cannot be found."
    nameless = expect_error(unload(), 400, "InvalidUserInput")
    assert nameless == "'lora_name' needs to be provided to unload a LoRA adapter."
    with pytest.raises(openai.NotFoundError):
        _complete(client, "chat")
    assert _complete(client, "sql") == _reference(folders, "sql")  # the server kept serving
