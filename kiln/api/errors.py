"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with vLLM's type names."""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

import msgspec
from starlette.responses import Response

from kiln.api.responses import ErrorInfo, ErrorResponse
from kiln.engine.async_engine import EngineDeadError
from kiln.engine.queue_limits import Overloaded
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# Anthropic's error types (/v1/messages) by status; other statuses: invalid_request_error below 500, else
# api_error.
ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}

_encoder = msgspec.json.Encoder()
_UNKNOWN = re.compile(r"Object contains unknown field `(.*)`")
# The fields an engine ValueError may begin with: the params, and the options beside them.
_ENGINE_FIELDS = (
    frozenset(SamplingParams.__struct_fields__)
    | frozenset(PoolingParams.__struct_fields__)
    | {"priority", "cache_salt"}
)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        """kind: the error's type where vLLM names it apart from its status (InvalidUserInput)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind

    def body(self) -> ErrorResponse:
        kind = (
            self.kind
            or ERROR_TYPES.get(self.status)
            or HTTPStatus(self.status).phrase.replace(" ", "") + "Error"
        )
        return ErrorResponse(ErrorInfo(self.message, kind, self.param, self.status))

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`: the message names the
        field, as the shape has no place for it."""
        other = "api_error" if self.status >= 500 else "invalid_request_error"
        kind = ANTHROPIC_TYPES.get(self.status, other)
        named = self.param is None or self.param in self.message
        message = self.message if named else f"{self.param}: {self.message}"
        return {"type": "error", "error": {"type": kind, "message": message}}

    def response(self, anthropic: bool = False) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        body = self.anthropic_body() if anthropic else self.body()
        return Response(_encoder.encode(body), self.status, headers, "application/json")


def bad_request(error: ValueError) -> APIError:
    """msgspec ends its message with the path of the bad field; kiln's own ValueErrors begin with it."""
    message = str(error)
    if isinstance(error, msgspec.DecodeError) and not isinstance(error, msgspec.ValidationError):
        return APIError(400, f"the request body is not valid JSON: {message}")
    if isinstance(error, msgspec.ValidationError):
        what, _, where = message.partition(" - at `$.")
        param = where.rstrip("`").split("[")[0].split(".")[0] or None
        unknown = _UNKNOWN.fullmatch(what)
        if unknown is not None:  # a field kiln does not implement: a 400 that names it, never silence
            name = unknown[1]
            place = f" in `{where.rstrip('`')}`" if where else ""
            message = f"unsupported field `{name}`{place}: kiln does not implement it"
            return APIError(400, message, param or name)
    else:
        first = message.split(" ", 1)[0]
        param = first if first in _ENGINE_FIELDS else None
    return APIError(400, message, param)


def as_api_error(error: BaseException) -> APIError:
    """Any exception as the error a client sees. Only an unexpected one is logged with its traceback."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, (EngineDeadError, Overloaded)):
        return APIError(503, str(error))
    if isinstance(error, ValueError):
        return bad_request(error)
    log.error("internal error", exc_info=error)
    return APIError(500, f"internal server error: {type(error).__name__}: {error}")
