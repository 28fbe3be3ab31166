"""The FlashInfer modules kiln's attention and sampling load, named as their wrappers' plans name them, and
built in one parallel run before the first step."""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)


def kernel_specs(
    head_dim: int, dtype: torch.dtype, prefill: str, sliding_window: bool, tensor_cores: bool
) -> list:
    """FlashInfer's JitSpecs for every module this attention's steps load (decode, prefill by the
    `prefill` backend, paging) and sampling: the same arguments the wrappers' plan() passes, so the same
    names and build folders."""
    from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.page import gen_page_module
    from flashinfer.jit.sampling import gen_sampling_module

    common = (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, sliding_window, False)
    decode = (
        gen_batch_prefill_module("fa2", *common, False) if tensor_cores else gen_batch_decode_module(*common)
    )
    return [
        gen_batch_prefill_module(prefill, *common, False),
        decode,
        gen_page_module(),
        gen_sampling_module(),
    ]


def prefill_backend(dtype: torch.dtype, device: torch.device) -> str:
    """What the prefill wrapper's `auto` resolves to here: "fa3" on Hopper, "fa2" elsewhere."""
    from flashinfer.utils import determine_attention_backend

    return determine_attention_backend(device, 0, False, False, dtype, dtype)


def build_kernels(
    head_dim: int, dtype: torch.dtype, prefill: str, sliding_window: bool, tensor_cores: bool
) -> None:
    """Builds every module kernel_specs lists in one parallel ninja run, instead of one nvcc build after
    another on first use. Once built, ninja finds them up to date and this takes well under a second."""
    from flashinfer.jit import build_jit_specs

    specs = kernel_specs(head_dim, dtype, prefill, sliding_window, tensor_cores)
    clock = time.perf_counter()
    build_jit_specs(list({spec.name: spec for spec in specs}.values()))
    log.info(
        "FlashInfer kernels (head_dim %d, %s%s%s): ready in %.1f s",
        head_dim,
        str(dtype).removeprefix("torch."),
        ", sliding window" if sliding_window else "",
        ", tensor-core decode" if tensor_cores else "",
        time.perf_counter() - clock,
    )
