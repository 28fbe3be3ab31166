"""The ASGI middleware `kiln serve` adds as its flags ask (vLLM's): CORS, X-Request-Id headers, and the
operator's own (--middleware)."""

from __future__ import annotations

import importlib
import inspect
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.server_config import ServerConfig


def middleware(server: ServerConfig) -> list[Middleware]:
    """The operator's middleware outermost, in the order given; then CORS where origins are allowed, and
    X-Request-Id headers where asked (vLLM's)."""
    out = [own(path) for path in server.middleware]
    if server.allowed_origins:
        cors = {
            "allow_origins": server.allowed_origins,
            "allow_methods": server.allowed_methods,
            "allow_headers": server.allowed_headers,
            "allow_credentials": server.allow_credentials,
        }
        out.append(Middleware(CORSMiddleware, **cors))
    if server.enable_request_id_headers:
        out.append(Middleware(RequestIdHeader))
    return out


def own(path: str) -> Middleware:
    """vLLM's --middleware: an import path to an ASGI middleware class, or to an async function
    (request, call_next) run as an HTTP middleware. ValueError if it is neither."""
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--middleware {path!r}: cannot import it ({e})") from None
    if inspect.isclass(found):
        return Middleware(found)
    if inspect.iscoroutinefunction(found):
        return Middleware(BaseHTTPMiddleware, dispatch=found)
    raise ValueError(f"--middleware {path!r}: not an import path to a class or an async function")


class RequestIdHeader:
    """vLLM's --enable-request-id-headers: each response's X-Request-Id is the request's, else random."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)
