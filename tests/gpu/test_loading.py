"""Weights reach a GPU through pinned buffers and a side stream (staging.py): byte for byte what a CPU load
reads, with the default ring and with chunks small enough to reuse each pinned buffer many times, and
without falling back to direct copies."""

from pathlib import Path

import pytest
import torch

from kiln.models.loader import load_model
from kiln.models.staging import Stager
from kiln.ops.backend import TORCH_KERNELS
from tests.models.tiny import build


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # float16: the float32 file converts on the GPU
@pytest.mark.parametrize("chunk", [None, 1001], ids=["default-ring", "small-chunks"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_staged_weights_on_the_gpu_equal_a_cpu_load(
    tmp_path: Path, arch: str, chunk: int | None, dtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    build(arch, tmp_path, 128)
    cpu = load_model(tmp_path, dtype, "cpu", TORCH_KERNELS)
    cuda = torch.device("cuda")
    stager = None if chunk is None else Stager(cuda, chunk=chunk, buffers=3, threads=2)
    gpu = load_model(tmp_path, dtype, cuda, TORCH_KERNELS, stager=stager)
    assert "staged weight loading failed" not in caplog.text  # no fallback to direct copies
    for (name, a), b in zip(cpu.state_dict().items(), gpu.state_dict().values(), strict=True):
        assert b.device.type == "cuda" and torch.equal(a, b.cpu()), name
