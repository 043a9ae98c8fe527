"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Every error also carries the request's id (``error.request_id``, the same value as the
``x-request-id`` response header), so a client can quote it from the body alone.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvserve.http")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error response: status, the OpenAI error fields, and extra response headers
    (``Retry-After``, rate-limit headers, ``WWW-Authenticate`` ...)."""

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
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    error: dict[str, Any] = {
        "message": message,
        "type": _TYPES.get(status, "server_error"),
        "param": param,
        "code": code,
    }
    if request_id is not None:
        error["request_id"] = request_id
    return {"error": error}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    request: Request | None = None,
) -> JSONResponse:
    rid = getattr(request.state, "request_id", None) if request is not None else None
    return JSONResponse(error_body(status, message, param, code, rid), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        response = error_response(exc.status, exc.message, exc.param, exc.code, request)
        response.headers.update(exc.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p)]
        param = ".".join(loc) or None
        kind = first.get("type", "")
        if kind == "extra_forbidden":
            message = f"unsupported parameter: {param}"
        elif kind == "json_invalid":
            message = f"invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            param = None
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return error_response(400, message, param, request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), request=request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = getattr(request.state, "request_id", None)
        log.exception("request %s failed", rid)
        return error_response(
            500, f"internal error while serving request {rid}: {exc}", request=request
        )


# pydantic names the member of a union that a value failed in its error's location
# ("prompt", "list[int]", 0): a type, not a field of the request.
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _union_tag(part: object) -> bool:
    """Whether a location part is a union member's tag (a type name, ``list[int]``, a
    model's class name), which ``error.param`` leaves out: OpenAI's param is the path."""
    return isinstance(part, str) and (part in _TYPE_NAMES or "[" in part or part[:1].isupper())
