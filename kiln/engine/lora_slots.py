"""Which LoRA adapter is in which of the model's slots. The scheduler keeps a step's distinct adapters
within the slots; an adapter a step needs takes a slot no adapter of that step holds. Adapters read from
disk are kept on the host, the most recently used max_cpu_loras of them (vLLM's --max-cpu-loras)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from kiln.engine.request import Request
from kiln.lora_request import LoRARequest
from kiln.models.decoder import DecoderModel
from kiln.models.lora_adapter import Adapter, load_adapter
from kiln.ops.lora import LoraStack

log = logging.getLogger(__name__)


class LoraSlots:
    def __init__(self, model: DecoderModel, max_cpu_loras: int | None) -> None:
        assert model.lora is not None
        self.model = model
        # By the adapted layer's name, as Adapter.weights: the stack is its `lora`.
        self.stacks: dict[str, LoraStack] = {
            name.removesuffix(".lora"): m for name, m in model.named_modules() if isinstance(m, LoraStack)
        }
        self.slots: list[int | None] = [None] * model.lora.max_loras  # each slot's adapter id
        self.capacity = max_cpu_loras or model.lora.max_loras
        self.adapters: OrderedDict[int, Adapter] = OrderedDict()  # on the host, least recently used first

    def load(self, request: LoRARequest) -> Adapter:
        """The adapter, read (and checked: ValueError) unless it is on the host already."""
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is None or adapter.request != request:
            adapter = load_adapter(request, self.model)
            log.info("loaded LoRA adapter %s (id %d, rank %d) from %s", request.lora_name,
                     request.lora_int_id, adapter.rank, request.lora_path)  # fmt: skip
        self.keep(adapter)
        return adapter

    def keep(self, adapter: Adapter) -> None:
        lora_id = adapter.request.lora_int_id
        held = self.adapters.get(lora_id)
        if held is not None and held.request != adapter.request:  # the id now names another adapter
            self.slots = [None if a == lora_id else a for a in self.slots]
        self.adapters[lora_id] = adapter
        self.adapters.move_to_end(lora_id)
        while len(self.adapters) > self.capacity:
            self.adapters.popitem(last=False)

    def drop(self, lora_int_id: int) -> None:
        """Forgets the host copy; a slot holding it keeps it until another adapter needs the slot."""
        self.adapters.pop(lora_int_id, None)

    def requests_info(self, running: Iterable[Request], waiting: Iterable[Request]) -> dict[str, Any]:
        """vLLM's lora_requests_info: the slots, and the adapters of the running and waiting requests."""

        def names(reqs: Iterable[Request]) -> str:
            return ",".join(sorted({r.lora.lora_name for r in reqs if r.lora is not None}))

        return {"max_lora": len(self.slots), "running": names(running), "waiting": names(waiting)}

    def assign(self, loras: list[LoRARequest | None]) -> np.ndarray:
        """Each request's slot (-1: no adapter), loading into slots the adapters not in one."""
        ids = [-1 if r is None else r.lora_int_id for r in loras]
        needed = {i: r for i, r in zip(ids, loras, strict=True) if r is not None}
        slot_of = {a: s for s, a in enumerate(self.slots) if a is not None}
        # Empty slots first: a held adapter stays for a later step that may want it.
        free = sorted(
            (s for s, a in enumerate(self.slots) if a not in needed), key=lambda s: self.slots[s] is not None
        )
        for lora_id, request in needed.items():
            if lora_id not in slot_of:
                slot = free.pop(0)  # the scheduler admits no more adapters a step than there are slots
                self._write(slot, self.load(request))
                slot_of[lora_id] = slot
        return np.array([slot_of.get(i, -1) for i in ids], dtype=np.int64)

    @torch.inference_mode()
    def _write(self, slot: int, adapter: Adapter) -> None:
        for name, stack in self.stacks.items():
            stack.write(slot, {shard: (a, b) for shard, a, b in adapter.weights.get(name, [])})
        self.slots[slot] = adapter.request.lora_int_id
        log.debug("LoRA adapter %s in slot %d", adapter.request.lora_name, slot)
