"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`, and on
Anthropic's Messages routes (ANTHROPIC_PATHS) in Anthropic's: `{"type": "error", "error":
{"type", "message"}}`.

Handlers raise `ApiError`; `server/app.py` turns it (and Starlette's 404/405) into a response.
Status codes used:
  400 invalid input (param names the field), 401 bad or missing API key, 404 unknown route,
  405 wrong method, 413 body too large, 429 queue full (Retry-After), 500 a bug or an engine
  failure during generation, 501 the model cannot do what was asked (/infill without
  fill-in-the-middle tokens), 503 engine loading/failed/stopped, 504 generation deadline passed.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
RATE_LIMIT = "rate_limit_error"
UNAVAILABLE = "unavailable_error"
SERVER_ERROR = "server_error"
TIMEOUT = "timeout_error"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> Response:
        return json_response(self.body(), status=self.status, headers=self.headers)


# Routes whose errors, those of the middleware before them included, take Anthropic's shape
ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error"}


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    message = error.message if error.param is None or error.param in error.message else f"{error.message} ({error.param})"
    fallback = "invalid_request_error" if error.status < 500 else "api_error"
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(error.status, fallback), "message": message}}


def error_response(error: ApiError, path: str) -> Response:
    """The error's response on a route at `path`: Anthropic's shape on its Messages routes."""
    if any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS):
        return json_response(anthropic_error_body(error), status=error.status, headers=error.headers)
    return error.response()


def invalid(message: str, param: str | None) -> ApiError:
    """A 400 naming the offending field."""
    return ApiError(400, message, param=param, code="invalid_value" if param else "invalid_request")


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def json_bytes(body: Any) -> bytes:
    # allow_nan=False: a NaN logprob must never produce invalid JSON for clients.
    # backslashreplace: a lone surrogate (a JSON escape a model wrote in a call's arguments)
    # goes out as its JSON escape, inside the string it is in, where UTF-8 cannot hold it
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json_bytes(body), status_code=status, headers=headers, media_type="application/json")
