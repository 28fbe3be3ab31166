"""Engine configuration: msgspec Structs, one per concern. YAML files and CLI flags decode into these."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Section):
    model: str = "default"  # a model folder, or "default" for the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None  # defaults to the model folder
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0
    device: str = "cpu"


class CacheConfig(_Section):
    block_size: int = 16
    kv_cache_gib: float = 4.0
    enable_prefix_caching: bool = True


class SchedulerConfig(_Section):
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048


class CompileConfig(_Section):
    mode: Literal["eager", "compiled", "cudagraph"] = "eager"


class EngineConfig(_Section):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    compile: CompileConfig = msgspec.field(default_factory=CompileConfig)

    @classmethod
    def from_options(cls, model: str = "default", **options: Any) -> EngineConfig:
        """Flat keyword options (vLLM's LLM(...) style) placed into their sections by field name.
        `enforce_eager=True` is vLLM's spelling of compile mode "eager"."""
        if options.pop("enforce_eager", False):
            options["mode"] = "eager"
        sections: dict[str, dict[str, Any]] = {"model": {"model": model}}
        for key, value in options.items():
            section = next((s for s, t in _SECTIONS.items() if key in t.__struct_fields__), None)
            if section is None:
                raise TypeError(f"unknown engine option {key!r}")
            sections.setdefault(section, {})[key] = value
        return msgspec.convert(sections, cls)


_SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "compile": CompileConfig,
}
