"""kiln: an LLM serving stack whose speed comes from the compiler."""

__version__ = "0.1.0"
