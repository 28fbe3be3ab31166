"""vLLM's server load tracking (--enable-server-load-tracking): GET /load gives the requests in flight
that run the model, for a load balancer that routes to the least loaded replica."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

Endpoint = Callable[[Request], Awaitable[Response]]


class ServerLoad:
    def __init__(self) -> None:
        self.count = 0

    def counted(self, endpoint: Endpoint) -> Endpoint:
        """The endpoint, counted from its start until its response is done: a stream's at its last chunk
        or when its client leaves."""

        async def counted(request: Request) -> Response:
            self.count += 1
            try:
                response = await endpoint(request)
            except BaseException:
                self.count -= 1
                raise
            if isinstance(response, StreamingResponse):
                response.body_iterator = self._until_done(response.body_iterator)
            else:
                self.count -= 1
            return response

        return counted

    async def _until_done(self, chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.count -= 1
            await chunks.aclose()  # type: ignore[attr-defined]

    async def endpoint(self, request: Request) -> Response:
        """GET /load, as vLLM: {"server_load": N}, 0 while tracking is off."""
        return Response(msgspec.json.encode({"server_load": self.count}), media_type="application/json")
