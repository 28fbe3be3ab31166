from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """A LoRA adapter a request runs with, as vLLM's: a name, an id unique among the engine's adapters (it
    keys the prefix cache and the adapter slots), and the PEFT folder (adapter_config.json and
    adapter_model.safetensors). Positional as vLLM's: LoRARequest("sql", 1, "/adapters/sql")."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
