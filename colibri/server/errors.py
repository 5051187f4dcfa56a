"""API errors: one exception type, rendered as the JSON the official clients parse.

OpenAI shape ``{"error": {"message", "type", "param", "code"}}``. Under ``/v1/messages`` the
body also carries Anthropic's ``"type": "error"`` and an Anthropic error type, so both SDKs read
it. Never a stack trace: unexpected exceptions become a 500 with a generic message (the details
go to the structured log).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

__all__ = ["ApiError", "error_body", "error_response", "validation_error"]

# status -> (OpenAI type, Anthropic type)
_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    421: ("invalid_request_error", "invalid_request_error"),
    422: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class ApiError(Exception):
    """An error answered to the client: HTTP status, message, and the OpenAI fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    *,
    anthropic: bool = False,
) -> dict[str, Any]:
    """The JSON body for an error: OpenAI's, or Anthropic's (``"type": "error"`` and its error
    type names; ``param`` and ``code`` kept as extra fields)."""
    default = "server_error" if status >= 500 else "invalid_request_error"
    oai, anth = _TYPES.get(status, (default, "api_error" if status >= 500 else default))
    if anthropic:
        err = {"type": anth, "message": message, "param": param, "code": code}
        return {"type": "error", "error": err}
    return {"error": {"message": message, "type": oai, "param": param, "code": code}}


def error_response(exc: ApiError, *, anthropic: bool = False) -> JSONResponse:
    """A JSON response for ``exc`` (its status and headers)."""
    body = error_body(exc.status, exc.message, exc.param, exc.code, anthropic=anthropic)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


# pydantic's tags for the branch of a union a value was checked against ("str",
# "literal['none','auto']", "list[dict[str,any]]", "function-after[...]", a model class name):
# not part of the request's path
_BRANCH_TAG = re.compile(r"^([a-z][a-z0-9_-]*\[.*\]|str|int|float|bool|bytes|none|[A-Z]\w*)$")


def _request_path(loc: Sequence[int | str]) -> str:
    """A pydantic error location as the field's dotted path in the request."""
    return ".".join(str(x) for x in loc if not (isinstance(x, str) and _BRANCH_TAG.match(x)))


def validation_error(exc: ValidationError) -> ApiError:
    """422 naming the first bad field (``param`` is its dotted path in the request)."""
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = _request_path(first.get("loc", ()))
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    msg = f"{loc}: {first.get('msg', 'invalid')}{more}" if loc else str(first.get("msg"))
    return ApiError(422, msg, param=loc or None, code="invalid_value")


def is_anthropic(request: Request) -> bool:
    """Whether errors for this request use the Anthropic body (the Messages API path)."""
    return request.url.path.startswith("/v1/messages")
