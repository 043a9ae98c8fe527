"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Every error also carries the request's id (``error.request_id``, the same value as the
``x-request-id`` response header), so a client can quote it from the body alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.errors import InvalidRequestError

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

    @classmethod
    def invalid_request(cls, exc: InvalidRequestError, prefix: str = "") -> OpenAIError:
        """The 400 of an engine's refusal, with its parameter and code."""
        return cls(400, f"{prefix}{exc}", param=exc.param, code=exc.code)


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


def error_json(
    status: int,
    message: str,
    param: str | None = None,
    request_id: str | None = None,
) -> bytes:
    """``error_body`` as the bytes of the apps' own error responses (a ``JSONResponse``:
    compact, UTF-8), for the answers written below the app: the request-id middleware's
    and the HTTP protocol's (``openai/http_limits.py``)."""
    return bytes(JSONResponse(error_body(status, message, param, request_id=request_id)).body)


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
        message, param = validation_message(exc.errors())
        return error_response(400, message, param, request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":  # no such route
            detail = not_found_message(request.method, request.url.path)
        response = error_response(exc.status_code, detail, request=request)
        response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110 requires it)
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = getattr(request.state, "request_id", None)
        log.exception("request %s failed", rid)
        return error_response(
            500, f"internal error while serving request {rid}: {exc}", request=request
        )


def not_found_message(method: str, path: str) -> str:
    """A 404 for a path with no route, saying what is served instead: clients written for
    another OpenAI endpoint (the Agents SDK's default is the Responses API) get the fix."""
    shown = path if len(path) <= 200 else path[:200] + "…"
    text = f"Not Found: no route {method} {shown}"
    if path.rstrip("/").endswith("/v1/responses"):
        return (
            f"{text}; the Responses API is not served here: use Chat Completions "
            "(/v1/chat/completions; in the OpenAI Agents SDK, OpenAIChatCompletionsModel)"
        )
    if path.startswith("/v1/"):
        return f"{text}; the OpenAI API here is /v1/chat/completions, /v1/completions, /v1/models"
    return text


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """The message and ``param`` of a 400 for pydantic's errors: the most telling one
    (``_telling``), its location as the param, its text without pydantic's own prefixes."""
    first = _telling(errors) if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p)]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return f"unsupported parameter: {param}", param
    if kind == "json_invalid":
        return f"invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if kind == "finite_number":  # NaN or ±Infinity (as literals or as "nan", "inf" ...)
        return f"{param} must be a finite number, not NaN or infinity", param
    text = str(first.get("msg", "invalid value"))
    for prefix in _PYDANTIC_PREFIXES:  # a validator's ValueError or assert, as written
        text = text.removeprefix(prefix)
    return f"{param or 'body'}: {text}", param


# What pydantic puts before the message of a validator's ValueError or AssertionError.
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def _telling(errors: Sequence[Any]) -> Any:
    """The error to report: the first, unless it says only that a value is not of one
    member of a union (its location ends at the member's tag) while the value had the
    shape of exactly one other member, whose errors say what is wrong inside it (their
    locations go past its tag). ``tool_choice: {"type": "function"}`` is then
    "tool_choice.function: Field required", not "Input should be 'none', 'auto' or
    'required'". A value with the shape of several members (a prompt list mixing texts
    and token-id lists) keeps the first error: which member was meant is not known."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if not loc or not _union_tag(loc[-1]):
        return first
    at = len(loc) - 1  # where the union's member tag sits
    inside = [
        other
        for other in errors[1:]
        if len(other_loc := tuple(other.get("loc", ()))) > at + 1
        and other_loc[:at] == loc[:at]
        and _union_tag(other_loc[at])
    ]
    if len({tuple(other["loc"])[at] for other in inside}) == 1:
        return inside[0]
    return first


# pydantic names the member of a union that a value failed in its error's location
# ("prompt", "list[int]", 0): a type, not a field of the request.
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _union_tag(part: object) -> bool:
    """Whether a location part is a union member's tag (a type name, ``list[int]``, a
    model's class name), which ``error.param`` leaves out: OpenAI's param is the path."""
    return isinstance(part, str) and (part in _TYPE_NAMES or "[" in part or part[:1].isupper())
