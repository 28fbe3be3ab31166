"""kiln's version, as installed: pyproject.toml is its one source."""

from importlib import metadata

try:
    VERSION = metadata.version("kiln")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    VERSION = "0+unknown"
