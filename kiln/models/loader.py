"""Loads a Hugging Face model folder into a DecoderModel, one safetensors shard at a time."""

import json
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm
from transformers import AutoConfig

from kiln.models.decoder import DecoderModel
from kiln.models.registry import spec_for
from kiln.models.spec import ArchSpec, ModelDims, Shard, expand, ignored, rule_applies
from kiln.models.staging import Stager
from kiln.ops.attention import AttentionImpl
from kiln.ops.backend import Kernels, torch_kernels
from kiln.ops.lora import LoraDims
from kiln.ops.torch_attention import TORCH_ATTENTION
from kiln.platform import native_matmul_dtypes

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class _Target:
    param: str
    shard: Shard
    expert: int | None
    transpose: bool


def load_config(path: Path, overrides: dict[str, Any] | None = None) -> Any:
    """The folder's config.json, with vLLM's --hf-overrides laid over its top-level keys."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json; a model folder needs config.json and *.safetensors")
    return AutoConfig.from_pretrained(path, local_files_only=True, **(overrides or {}))


def resolve_dtype(dtype: str, config: Any, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        return DTYPES[dtype]
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, torch.dtype):
        declared = declared if declared in DTYPES.values() else torch.float32
    else:
        declared = DTYPES.get(str(declared), torch.float32)
    if declared != torch.float32:
        return declared
    # vLLM's rule: float32 checkpoints serve in 16 bits. A CPU that multiplies bfloat16 natively
    # (AVX512-BF16, AMX) does so at twice float32's rate, so bfloat16 there, as vLLM's CPU backend does.
    # Elsewhere float16: its weights widen at the same cost, and the default model's greedy tokens track
    # float32's for longer (BENCHMARKS.md).
    if device.type == "cpu" and torch.bfloat16 in native_matmul_dtypes(device):
        return torch.bfloat16
    return torch.float16


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if missing or not files:
        raise FileNotFoundError(
            f"{path}: missing safetensors file(s): {[str(m) for m in missing] or '*.safetensors'}"
        )
    return files


def resolve_model(model: str) -> Path:
    if model == "default":
        from kiln.models.convert import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {model!r} does not exist (kiln never downloads from a hub)")
    return path


def inspect_model(
    path: Path, dtype: str, device: torch.device, overrides: dict[str, Any] | None = None
) -> tuple[ArchSpec, ModelDims, torch.dtype]:
    """The architecture, shapes and serving dtype on `device` of a model folder, without its weights."""
    config = load_config(path, overrides)
    spec = spec_for(getattr(config, "architectures", None))
    return spec, spec.dims(config), resolve_dtype(dtype, config, device)


def load_model(
    path: Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    kernels: Kernels | None = None,
    attention: AttentionImpl = TORCH_ATTENTION,
    stager: Stager | None = None,
    dummy: bool = False,
    hf_overrides: dict[str, Any] | None = None,
    lora: LoraDims | None = None,
) -> DecoderModel:
    """kernels: None is the torch references for this device and dtype. stager: None stages through
    pinned memory on a GPU (staging.py) and copies directly on a CPU. A stager that fails (its pinned
    memory, stream or reads) is logged, and the weights are loaded again with direct copies. dummy: no
    weights read, each drawn uniformly from +-1e-3 (vLLM's --load-format dummy, to measure speed).
    hf_overrides: laid over config.json (vLLM's --hf-overrides). lora: LoRA adapter slots, empty."""
    device = torch.device(device)
    spec, dims, torch_dtype = inspect_model(path, dtype, device, hf_overrides)
    kernels = kernels or torch_kernels(device, torch_dtype)
    with torch.device("meta"):
        model = DecoderModel(spec, dims, kernels, attention, lora).to(torch_dtype)
    model.to_empty(device=device)
    if dummy:
        generator = torch.Generator(device).manual_seed(1234)
        with torch.no_grad():
            for param in model.parameters():
                param.uniform_(-1e-3, 1e-3, generator=generator)
        model.prepare(dims.max_positions)
        return model.eval()
    files = safetensors_files(path)
    staged = stager is not None or device.type == "cuda"
    try:
        load_weights(model, spec, dims, files, (stager or Stager(device)) if staged else None)
    except (RuntimeError, OSError) as e:  # the stager's pinned memory, stream or reads; not a bad checkpoint
        if not staged:
            raise
        log.warning(
            "staged weight loading failed (%s: %s); loading again with direct copies", type(e).__name__, e
        )
        load_weights(model, spec, dims, files)
    model.prepare(dims.max_positions)
    return model.eval()


def weight_map(spec: ArchSpec, dims: ModelDims) -> dict[str, _Target]:
    return {
        src: _Target(param, shard, expert, rule.transpose)
        for rule in spec.rules
        if rule_applies(rule, dims)
        for src, param, shard, expert in expand(rule, dims)
    }


def load_weights(
    model: DecoderModel, spec: ArchSpec, dims: ModelDims, files: list[Path], stager: Stager | None = None
) -> None:
    targets = weight_map(spec, dims)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    bar = tqdm(total=len(targets), desc="Loading weights", unit="tensor", leave=False)
    with bar, stager or nullcontext():
        for file in files:
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise WeightError(f"{file}: not a readable safetensors file ({e})") from e
            with handle as f:
                for raw in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    name = raw.removeprefix(spec.strip_prefix)
                    # A backbone's own save (Qwen3-Embedding's, a `*Model`'s) names its tensors without
                    # the "model." its causal LM puts before them.
                    if name not in targets and f"model.{name}" in targets:
                        name = f"model.{name}"
                    target = targets.get(name)
                    if target is None:
                        if not (
                            ignored(name, spec) or (name == "lm_head.weight" and dims.tie_word_embeddings)
                        ):
                            unexpected.append(raw)
                        continue
                    tensor = f.get_tensor(raw)
                    tensor = tensor.t() if target.transpose else tensor
                    dst = _destination(params[target.param], target, tensor, dims, raw)
                    if stager is None:
                        dst.copy_(tensor)
                    else:
                        stager.copy(dst, tensor, file, raw)
                    loaded.add(name)
                    bar.update()
    if unexpected:
        raise WeightError(f"unexpected tensor(s) in checkpoint for {spec.name}: {', '.join(unexpected[:8])}")
    missing = sorted(set(targets) - loaded)
    if missing:
        raise WeightError(f"missing tensor(s) in checkpoint for {spec.name}: {', '.join(missing[:8])}")
    log.info("loaded %d tensors from %d file(s)", len(loaded), len(files))


def _destination(
    param: torch.Tensor, t: _Target, tensor: torch.Tensor, d: ModelDims, name: str
) -> torch.Tensor:
    """The part of `param` that checkpoint tensor `name` fills."""
    dst = param.data if t.expert is None else param.data[t.expert]
    if t.shard in ("q", "k", "v"):
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[t.shard]
        dst = dst.narrow(0, start, size)
    elif t.shard in ("gate", "up"):
        half = dst.shape[0] // 2
        dst = dst.narrow(0, 0 if t.shard == "gate" else half, half)
    if dst.shape != tensor.shape:
        raise WeightError(f"{name}: shape {tuple(tensor.shape)} does not fit {t.param} {tuple(dst.shape)}")
    return dst
