import importlib.util

import pytest
import torch

from kiln.compile.cache import point_caches
from kiln.paths import cache_root

# FlashInfer reads its JIT cache's location once, on import: point it under KILN_CACHE_DIR first.
point_caches(cache_root())


@pytest.fixture(autouse=True)
def _needs_cuda_and_flashinfer() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none here): run on an H100/H200 through the device tool")
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs FlashInfer: pip install 'kiln[cuda]'")
