import importlib.util

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda_and_flashinfer() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none here): run on an H100/H200 through the device tool")
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs FlashInfer: pip install 'kiln[cuda]'")
