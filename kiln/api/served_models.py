"""The names a server answers to, as vLLM's OpenAIServingModels: the model's (--served-model-name) and its
LoRA adapters' (--lora-modules, and the runtime load/unload endpoints). A request's `model` names one of
them; GET /v1/models lists them."""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.api.responses import ModelCard, ModelList
from kiln.engine.async_engine import AsyncEngine
from kiln.lora_request import LoRARequest
from kiln.models.lora_adapter import AdapterNotFound

log = logging.getLogger(__name__)

INVALID = "InvalidUserInput"  # vLLM's type for a bad load or unload request


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # vLLM's: replace an adapter of that name


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str = ""
    lora_int_id: int | None = None


def vllm_flag(name: str) -> bool:
    """A vLLM switch from the environment, read as vLLM reads it ("1" or "true")."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true")


class ServedModels:
    """The adapters are the engine's served_loras (it resolves a request's adapter from them)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.name = names[0]  # what responses carry, and each adapter's parent
        self._ids = itertools.count(1)

    def check(self, model: str | None, engine: AsyncEngine | None) -> None:
        """A 404 for a name the server does not answer to, unless VLLM_SKIP_MODEL_NAME_VALIDATION."""
        served = engine.served_loras if engine is not None else {}
        if (
            not model
            or model in self.names
            or model in served
            or vllm_flag("VLLM_SKIP_MODEL_NAME_VALIDATION")
        ):
            return
        aliases = ", ".join(self.names)
        raise APIError(404, f"The model `{model}` does not exist. Valid aliases: {aliases}.", "model")

    async def list(self, engine: AsyncEngine, inputs: Inputs, request: Request, body: None) -> ModelList:
        """GET /v1/models: the model under each name, then each adapter, as vLLM's."""
        root, length = str(engine.model_path), engine.max_model_len
        cards = [ModelCard(id=name, root=root, max_model_len=length) for name in self.names]
        for name, lora in engine.served_loras.items():
            cards.append(ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name or self.name))
        return ModelList(cards)

    async def add(self, engine: AsyncEngine, name: str, path: str, base: str | None = None) -> LoRARequest:
        # As vLLM: a base_model_name counts only where it names a served base model.
        lora = LoRARequest(name, next(self._ids), path, base if base in self.names else None)
        await engine.add_lora(lora)
        engine.served_loras[name] = lora
        log.info("serving LoRA adapter %s (%s)", name, path)
        return lora

    async def load(
        self, engine: AsyncEngine, inputs: Inputs, request: Request, body: Any
    ) -> PlainTextResponse:
        """POST /v1/load_lora_adapter: vLLM's messages."""
        assert isinstance(body, LoadLoRAAdapterRequest)
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", kind=INVALID)
        if name in self.names:
            raise APIError(
                400, f"The lora adapter '{name}' conflicts with a served base model.", kind=INVALID
            )
        old = engine.served_loras.get(name)
        if old is not None and not body.load_inplace:
            message = (
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                "place, set 'load_inplace' to True."
            )
            raise APIError(400, message, kind=INVALID)
        try:
            await self.add(engine, name, path)
        except AdapterNotFound as e:
            raise APIError(404, str(e)) from None
        if old is not None:
            engine.remove_lora(old.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(
        self, engine: AsyncEngine, inputs: Inputs, request: Request, body: Any
    ) -> PlainTextResponse:
        """POST /v1/unload_lora_adapter: requests running with it finish with it."""
        assert isinstance(body, UnloadLoRAAdapterRequest)
        name = body.lora_name
        if not name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", kind=INVALID)
        lora = engine.served_loras.pop(name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.")
        engine.remove_lora(lora.lora_int_id)
        log.info("stopped serving LoRA adapter %s", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
