"""The engine's model, built once for its device: the backend chosen, the attention made for the KV
cache's dtype, the layer kernels, and the weights loaded with them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.compile.buckets import BucketPlan
from kiln.compile.cache import import_builds
from kiln.config import EngineConfig
from kiln.models.decoder import DecoderModel
from kiln.models.loader import DTYPES, load_model
from kiln.models.spec import ModelDims
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


def build_model(
    config: EngineConfig, path: Path, device: torch.device, dims: ModelDims, dtype: torch.dtype,
    max_model_len: int,
) -> Built:  # fmt: skip
    # The kernels' part: choosing the backend loads kiln_cpu (built on first use), making the attention
    # builds FlashInfer's modules (or finds them built, in the cache root or an imported export).
    start = time.perf_counter()
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
        dims, config.cache.block_size, max_model_len, max_graph_batch, dtype, kv_dtype, device
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
