"""Tiny random models of every supported architecture, built and saved by transformers itself."""

from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

VOCAB = 256
_COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
_LLAMA = dict(_COMMON, hidden_size=64, intermediate_size=128, max_position_embeddings=256)

CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", _LLAMA),
    "llama3": (
        "LlamaConfig",
        dict(
            _LLAMA,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "mistral": ("MistralConfig", dict(_LLAMA, sliding_window=16)),
    "qwen2": ("Qwen2Config", dict(_LLAMA, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(_LLAMA, head_dim=32)),
    "mixtral": ("MixtralConfig", dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            _LLAMA,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256)),
}


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer over VOCAB tokens, so the engine can detokenize tiny models' ids."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)


def with_head_dim(kwargs: dict, head_dim: int) -> dict:
    """The same architecture with wider heads (4 heads of head_dim): FlashInfer serves 64, 128 and 256."""
    width = "n_embd" if "n_embd" in kwargs else "hidden_size"
    out = dict(kwargs, **{width: kwargs.get("num_attention_heads", kwargs.get("n_head")) * head_dim})
    if "head_dim" in kwargs:
        out["head_dim"] = head_dim
    return out


def build(name: str, path: Path, head_dim: int | None = None, **overrides: Any) -> torch.nn.Module:
    """Saves a seeded random model (fp32 safetensors + tokenizer) to path; returns transformers' model.
    head_dim widens the model to that head size (otherwise 16, or 32 for qwen3); overrides set config
    fields."""
    config_cls, kwargs = CONFIGS[name]
    kwargs = with_head_dim(kwargs, head_dim) if head_dim else kwargs
    kwargs = dict(kwargs, **overrides)
    config = getattr(transformers, config_cls)(**kwargs, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # The default init is tiny; a wider spread gives the greedy argmax clear margins.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    save_tokenizer(path)
    return model.eval()


def build_default_vocab(
    path: Path,
    tokenizer_dir: Path,
    hidden_size: int = 64,
    added: tuple[str, ...] = (),
    special: tuple[str, ...] = (),
) -> Path:
    """A 2-layer random Llama with the default model's tokenizer and chat template (vocabulary 49,152, and
    the `added` tokens, then the `special` ones, after it): the API around it is real, and its forward
    costs next to nothing. Head dim: hidden_size / 4."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(list(added))
    tokenizer.add_tokens(list(special), special_tokens=True)
    config = transformers.LlamaConfig(
        **dict(_LLAMA, vocab_size=len(tokenizer), max_position_embeddings=8192, hidden_size=hidden_size),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
