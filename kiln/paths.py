"""Where kiln keeps files between runs."""

import os
from pathlib import Path


def cache_root() -> Path:
    """`$KILN_CACHE_DIR`, else `~/.cache/kiln`; read on every call so tests and users can redirect it."""
    env = os.environ.get("KILN_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kiln"
