"""A PEFT LoRA adapter folder read onto the model's adapted layers: adapter_config.json and
adapter_model.safetensors, each lora_A/lora_B pair placed by the model's own checkpoint names (the
architecture's weight rules), B scaled by lora_alpha / r (or / sqrt(r) with rsLoRA)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from kiln.lora_request import LoRARequest
from kiln.models.loader import weight_map

if TYPE_CHECKING:
    from kiln.models.decoder import DecoderModel

_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight")
_SHARDS = {None: None, "q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}


class AdapterNotFound(ValueError):
    def __init__(self, request: LoRARequest) -> None:
        super().__init__(f"Loading lora {request.lora_name} failed: No adapter found for {request.lora_path}")


@dataclass(slots=True)
class Adapter:
    request: LoRARequest
    rank: int
    # kiln module name (a Linear with slots) -> (shard, A [r, in], B scaled [out, r]) for each adapted shard
    weights: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]


def load_adapter(request: LoRARequest, model: DecoderModel) -> Adapter:
    """Reads and checks the adapter; ValueError names what does not fit the model or its slots."""
    assert model.lora is not None, "the model was built without LoRA slots"
    folder = Path(request.lora_path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    name = request.lora_name
    if not config_file.is_file():
        raise AdapterNotFound(request)
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: no readable {config_file} ({e})") from None
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", config.get("r", 0)))
    if not 0 < rank <= model.lora.max_rank:
        raise ValueError(
            f"LoRA adapter {name!r}: LoRA rank {rank} is greater than max_lora_rank {model.lora.max_rank}"
            if rank > 0
            else f"LoRA adapter {name!r}: adapter_config.json has no rank r"
        )
    extras = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern")
    unsupported = [k for k in extras if config.get(k)]
    unsupported += ["bias"] if config.get("bias", "none") not in ("none", None) else []
    if unsupported:
        given = ", ".join(f"{k} {config[k]!r}" for k in unsupported)
        raise ValueError(f"LoRA adapter {name!r}: {given}: not supported")
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    targets = _targets(model)
    pairs: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                m = _KEY.fullmatch(key)
                target = None if m is None else targets.get(m["module"])
                if m is None or target is None:
                    raise ValueError(f"LoRA adapter {name!r}: {key} adapts no layer kiln serves adapters on")
                pairs.setdefault(target, {})[m["ab"]] = f.get_tensor(key).float()
    except (SafetensorError, OSError) as e:
        raise ValueError(f"LoRA adapter {name!r}: no readable {weights_file} ({e})") from None
    weights: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (module, shard), ab in pairs.items():
        stack = model.get_submodule(module).lora
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} has lora_{set(ab).pop()} without its pair")
        a, b = ab["A"], ab["B"]
        # A whole fused layer's adapter (GPT-2's c_attn) is each shard's, with B split by the shard's rows.
        outs = stack.shards if shard is None else [stack.shards[shard]]
        if a.shape != (rank, stack.a.shape[1]) or b.shape != (sum(outs), rank):
            raise ValueError(
                f"LoRA adapter {name!r}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                f"not fit rank {rank} on a layer of {stack.a.shape[1]} -> {sum(outs)}"
            )
        parts = b.split(outs) if shard is None else [b]
        shards = range(len(outs)) if shard is None else [shard]
        weights.setdefault(module, []).extend((s, a, p * scale) for s, p in zip(shards, parts, strict=True))
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    return Adapter(request, rank, weights)


def _targets(model: DecoderModel) -> dict[str, tuple[str, int | None]]:
    """Checkpoint module name (model.layers.0.self_attn.q_proj) -> (kiln module with slots, its shard;
    None: the whole layer), under each name PEFT may give it."""
    out = {}
    for src, t in weight_map(model.spec, model.dims).items():
        if t.expert is not None or not src.endswith(".weight"):
            continue
        module = t.param.removesuffix(".weight")
        if getattr(model.get_submodule(module), "lora", None) is not None:
            name = src.removesuffix(".weight")
            for alias in (name, name.removeprefix("model."), model.spec.strip_prefix + name):
                out[alias] = (module, _SHARDS[t.shard])
    return out
