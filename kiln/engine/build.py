"""The engine's model, built once for its device: the backend chosen, the attention made for the KV
cache's dtype, the layer kernels, and the weights loaded with them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from kiln.compile.buckets import BucketPlan
from kiln.compile.cache import import_builds
from kiln.config import EngineConfig
from kiln.models.decoder import DecoderModel
from kiln.models.loader import DTYPES, inspect_model, load_model
from kiln.models.spec import ArchSpec, ModelDims
from kiln.ops.attention import kv_cache_dtype
from kiln.ops.backend import Backend, choose_backend
from kiln.ops.lora import LoraDims
from kiln.paths import cache_root

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Built:
    backend: Backend
    model: DecoderModel
    kv_dtype: torch.dtype  # what the KV cache stores; the attention was made for it
    kernels_s: float  # choosing the backend and building its kernels; the rest was loading weights


@dataclass(slots=True)
class Shape:
    config: EngineConfig  # the scheduler's limits set for the device; hf_overrides as the model was read
    spec: ArchSpec
    dims: ModelDims
    dtype: torch.dtype
    max_model_len: int


def model_shape(config: EngineConfig, path: Path, device: torch.device) -> Shape:
    """The model's architecture, shapes and serving dtype, and the context the engine serves: the
    config's max_model_len, within the model's positions (and its sliding window, where
    --disable-sliding-window makes attention full)."""
    spec, dims, dtype = inspect_model(path, config.model.dtype, device, config.model.hf_overrides)
    longest, what = dims.max_positions, "max_position_embeddings"
    if config.model.disable_sliding_window and dims.sliding_window:
        longest, what = min(longest, dims.sliding_window), "sliding_window (--disable-sliding-window)"
        # As vLLM: the window leaves the model's config, so the model is built with full attention.
        overrides = {**(config.model.hf_overrides or {}), "sliding_window": None}
        model = msgspec.structs.replace(config.model, hf_overrides=overrides)
        config = msgspec.structs.replace(config, model=model)
        spec, dims, dtype = inspect_model(path, config.model.dtype, device, overrides)
    max_model_len = config.model.max_model_len or longest
    if max_model_len > longest:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's {what} {longest}")
    if device.type == "cuda":
        gpu = torch.cuda.get_device_properties(device)
        scheduler = config.scheduler.on("cuda", gpu.total_memory, gpu.name, max_model_len)
    else:
        scheduler = config.scheduler.on(device.type, max_model_len=max_model_len)
    return Shape(msgspec.structs.replace(config, scheduler=scheduler), spec, dims, dtype, max_model_len)


def build_model(shape: Shape, path: Path, device: torch.device) -> Built:
    # The kernels' part: choosing the backend loads kiln_cpu (built on first use), making the attention
    # builds FlashInfer's modules (or finds them built, in the cache root or an imported export).
    start = time.perf_counter()
    config, dims, dtype = shape.config, shape.dims, shape.dtype
    if config.compile.cache_file is not None:
        import_builds(Path(config.compile.cache_file), cache_root())
    b = config.backend
    backend = choose_backend(b.kernels, b.attention, b.sampler, device, dims.head_dim, dtype, b.deterministic)
    kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, dtype)
    if kv_dtype == torch.float8_e4m3fn:
        # FlashInfer's K/V writer is Triton's, whose e4m3 conversion needs sm_89 (fp8e4nv); e5m2 is sm_80's.
        if backend.attention == "flashinfer" and (cc := torch.cuda.get_device_capability(device)) < (8, 9):
            raise ValueError(
                f"cache.kv_cache_dtype {config.cache.kv_cache_dtype!r} (e4m3) needs a GPU of compute "
                f"capability 8.9 or more with backend.attention 'flashinfer' (this one is {cc[0]}.{cc[1]}): "
                "use fp8_e5m2"
            )
        log.warning(
            "KV cache in fp8_e4m3 with a scale of 1.0 (kiln reads no k/v scales from a checkpoint): K and V "
            "beyond +-448 saturate"
        )
    max_graph_batch = BucketPlan.from_config(config).decode_sizes[-1]
    attention = backend.make_attention(
        dims, config.cache.block_size, shape.max_model_len, max_graph_batch, dtype, kv_dtype, device
    )
    kernels = backend.layer_kernels(device, dtype)
    built = time.perf_counter() - start
    m, lo = config.model, config.lora
    lora = LoraDims(lo.max_loras, lo.max_lora_rank, DTYPES.get(lo.lora_dtype)) if lo.enable_lora else None
    dummy = m.load_format == "dummy"
    model = load_model(
        path, m.dtype, device, kernels, attention, dummy=dummy, hf_overrides=m.hf_overrides, lora=lora
    )
    return Built(backend, model, kv_dtype, built)
