"""vLLM's development endpoints (served with VLLM_SERVER_DEV_MODE=1, as vLLM serves them): pause and resume
generation, as RL trainers do around a weight update, and forget the prefix cache."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from kiln.api.errors import APIError
from kiln.api.inputs import Inputs
from kiln.engine.async_engine import AsyncEngine

MODES = ("abort", "wait", "keep")


async def pause(engine: AsyncEngine, inputs: Inputs, request: Request, body: None) -> dict[str, str]:
    """?mode=abort (the default: abort what is in flight), wait (let it finish) or keep (freeze it);
    ?clear_cache=true (the default, as vLLM): forget the prefix cache once paused (not under keep)."""
    mode = request.query_params.get("mode", "abort")
    if mode not in MODES:
        raise APIError(400, f"mode must be abort, wait or keep, not {mode!r}", "mode")
    await engine.pause(mode, _flag(request, "clear_cache", True))  # type: ignore[arg-type]
    return {"status": "paused"}


async def resume(engine: AsyncEngine, inputs: Inputs, request: Request, body: None) -> dict[str, str]:
    engine.resume()
    return {"status": "resumed"}


async def is_paused(engine: AsyncEngine, inputs: Inputs, request: Request, body: None) -> dict[str, bool]:
    return {"is_paused": engine.paused}


async def reset_prefix_cache(
    engine: AsyncEngine, inputs: Inputs, request: Request, body: None
) -> dict[str, bool]:
    """{"success": false} while running requests hold blocks, unless ?reset_running_requests=true preempts
    them first; ?reset_external is accepted: kiln keeps no prefix cache outside the engine."""
    _flag(request, "reset_external", False)
    running = _flag(request, "reset_running_requests", False)
    return {"success": await engine.reset_prefix_cache(running)}


def _flag(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes", "on"):
        return True
    if value.lower() in ("false", "0", "no", "off"):
        return False
    raise APIError(400, f"{name} must be true or false, not {value!r}", name)


DEV: list[tuple[str, Any, str]] = [
    ("/pause", pause, "POST"),
    ("/resume", resume, "POST"),
    ("/is_paused", is_paused, "GET"),
    ("/reset_prefix_cache", reset_prefix_cache, "POST"),
]
