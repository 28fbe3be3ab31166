"""Random LoRA adapters in PEFT's folder format, and transformers models with an adapter merged into their
weights: the reference an adapted kiln model is compared against."""

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linears(hf: torch.nn.Module, modules: tuple[str, ...]) -> dict[str, torch.nn.Module]:
    """The adapted layers by PEFT's name for them (model.layers.0.self_attn.q_proj)."""
    return {
        name: m
        for name, m in hf.named_modules()
        if name.rsplit(".", 1)[-1] in modules and hasattr(m, "weight")
    }


def save_adapter(
    path: Path,
    hf: torch.nn.Module,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    modules: tuple[str, ...] = LLAMA_MODULES,
    **config: object,
) -> Path:
    """A random adapter of every named layer of hf, saved as PEFT does (adapter_config.json,
    adapter_model.safetensors with base_model.model.<module>.lora_A/B.weight)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, m in _linears(hf, modules).items():
        # GPT-2's Conv1D keeps its weight as [in, out].
        out_f, in_f = (
            (m.weight.shape[1], m.weight.shape[0]) if type(m).__name__ == "Conv1D" else m.weight.shape
        )
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.2
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.2
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(modules),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(cfg | config))
    return path


def merged(hf: torch.nn.Module, adapter: Path) -> torch.nn.Module:
    """A copy of hf with the adapter's B A (scaled as PEFT scales it) added to each weight."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
    from safetensors.torch import load_file

    tensors = load_file(adapter / "adapter_model.safetensors")
    out = copy.deepcopy(hf)
    with torch.no_grad():
        for name, m in _linears(out, tuple(cfg["target_modules"])).items():
            delta = (
                scale
                * tensors[f"base_model.model.{name}.lora_B.weight"]
                @ tensors[f"base_model.model.{name}.lora_A.weight"]
            )
            m.weight += delta.t() if type(m).__name__ == "Conv1D" else delta
    return out.eval()
