"""What every API request passes before its body is decoded: the API key, and the body's size."""

from __future__ import annotations

import secrets

from starlette.requests import Request

from kiln.api.errors import APIError


def authorize(request: Request, keys: list[str], anthropic: bool) -> None:
    """401 unless the request carries one of the keys (none: any request passes). anthropic: the key may
    come as Anthropic's SDKs send it, in x-api-key."""
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if anthropic and "x-api-key" in request.headers:
        scheme, token = "bearer", request.headers["x-api-key"]
    # Every key compared, so the time taken tells nothing of which one nearly matched.
    matches = [secrets.compare_digest(token.encode(), key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        send = "'Authorization: Bearer <key>'" + (" or 'x-api-key: <key>'" if anthropic else "")
        raise APIError(401, f"missing or invalid API key: send {send}")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read while it stays within the limit (413 past it, before reading it all)."""
    too_large = APIError(413, f"request body is larger than the limit of {limit} bytes")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)
