"""The FlashInfer modules kiln's attention and sampling load, named as their wrappers' plans name them, and
built in one parallel run before the first step."""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)


def kernel_specs(
    head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, prefill: str, sliding_window: bool,
    tensor_cores: bool,
) -> list:  # fmt: skip
    """FlashInfer's JitSpecs for every module this attention's steps load (decode, prefill by the
    `prefill` backend, paging) and sampling: the same arguments the wrappers' plan() passes, so the same
    names and build folders."""
    from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.page import gen_page_module
    from flashinfer.jit.sampling import gen_sampling_module

    common = (dtype, kv_dtype, dtype, torch.int32, head_dim, head_dim, 0, sliding_window, False)
    decode = (
        gen_batch_prefill_module("fa2", *common, False) if tensor_cores else gen_batch_decode_module(*common)
    )
    return [
        gen_batch_prefill_module(prefill, *common, False),
        decode,
        gen_page_module(),
        gen_sampling_module(),
    ]


def prefill_backend(dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> str:
    """What the prefill wrapper's `auto` resolves to here: "fa3" on Hopper (but for an fp8 cache under
    16-bit queries), "fa2" elsewhere."""
    from flashinfer.utils import determine_attention_backend

    return determine_attention_backend(device, 0, False, False, dtype, kv_dtype)


def build_kernels(
    head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, prefill: str, sliding_window: bool,
    tensor_cores: bool,
) -> None:  # fmt: skip
    """Builds every module kernel_specs lists in one parallel ninja run, instead of one nvcc build after
    another on first use. Once built, ninja finds them up to date and this takes well under a second."""
    from flashinfer.jit import build_jit_specs

    specs = kernel_specs(head_dim, dtype, kv_dtype, prefill, sliding_window, tensor_cores)
    clock = time.perf_counter()
    build_jit_specs(list({spec.name: spec for spec in specs}.values()))
    log.info(
        "FlashInfer kernels (head_dim %d, %s, KV cache %s%s%s): ready in %.1f s",
        head_dim,
        str(dtype).removeprefix("torch."),
        str(kv_dtype).removeprefix("torch."),
        ", sliding window" if sliding_window else "",
        ", tensor-core decode" if tensor_cores else "",
        time.perf_counter() - clock,
    )
