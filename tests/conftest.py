from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model as a Hugging Face folder (converted once, then reused from the kiln cache)."""
    from kiln.models.convert import default_model_dir

    return default_model_dir()
