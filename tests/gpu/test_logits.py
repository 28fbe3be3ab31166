"""On CUDA the LM head stays 16-bit and multiplies straight into float32 logits."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.models.loader import load_model
from kiln.ops.backend import TORCH_KERNELS
from tests.models.tiny import build


@pytest.mark.parametrize("arch", ["llama", "qwen2"], ids=["own-head", "tied-head"])
@torch.inference_mode()
def test_logits_from_a_16_bit_head_match_a_float32_head(arch: str, tmp_path: Path) -> None:
    build(arch, tmp_path, 128)
    model = load_model(tmp_path, "bfloat16", torch.device("cuda"), TORCH_KERNELS)
    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    assert model.logits_weight is head and head.dtype == torch.bfloat16  # no float32 copy on the GPU
    for rows in (1, 3, 64):
        hidden = torch.randn(rows, head.shape[1], device="cuda", dtype=torch.bfloat16)
        logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        # The same bf16 values in float32: products are exact, only the summation order may differ.
        torch.testing.assert_close(logits, F.linear(hidden.float(), head.float()), rtol=1e-5, atol=1e-5)
