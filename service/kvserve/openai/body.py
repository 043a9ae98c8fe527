"""Request bodies of the hot endpoints, parsed and validated in one pass.

The completion endpoints (engine server and gateway) take the plain ``Request`` and call
``parse_body`` rather than declaring a pydantic body parameter and dependencies. FastAPI's
body and dependency handling costs about 0.1 ms of CPU per request on the 2-core dev host
(most of it in ``solve_dependencies``), time that lands in every TTFT and in the
gateway's per-request cost; pydantic-core validates the raw bytes with its own JSON parser
instead. Errors are the same ``RequestValidationError`` FastAPI raises, so the apps' one
handler turns them into OpenAI 400s. ``body_schema`` puts the model's schema in the
OpenAPI document, as a body parameter would.

The body is JSON only when the request says so, by FastAPI's rule (since 0.65.2): no
``Content-Type`` at all (a hand-written request; curl's ``-d`` sends
``application/x-www-form-urlencoded`` unless told otherwise), ``application/json``, or
any ``application/*+json``, parameters such as ``charset`` allowed. Any other type is a
415 that names it: a web page may make a browser send a ``text/plain``,
``application/x-www-form-urlencoded`` or ``multipart/form-data`` POST to another origin
without asking it first (no CORS preflight), and a server on localhost or inside a
cluster that read such a body as JSON would serve that page's request (CSRF).
A compressed body (``Content-Encoding`` other than ``identity``) is a 415 that says so,
not a JSON error; a UTF-8 byte-order mark before the JSON is ignored (RFC 8259 lets a
parser do so, and some Windows tools write one).
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from kvserve.openai.errors import OpenAIError

M = TypeVar("M", bound=BaseModel)
UTF8_BOM = b"\xef\xbb\xbf"
MAX_SHOWN = 100  # characters of a refused Content-Type the error repeats


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's JSON body as ``model``; ``RequestValidationError`` if it is not,
    ``OpenAIError`` 415 if it is sent as another type or compressed (before it is read)."""
    content_type = request.headers.get("content-type", "")
    if not is_json_type(content_type):
        raise OpenAIError(
            415,
            f"Content-Type {content_type[:MAX_SHOWN]!r} is not supported: send the body as "
            "JSON, with Content-Type: application/json",
            param="content-type",
        )
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise OpenAIError(
            415,
            f"Content-Encoding {encoding!r} is not supported: send the JSON body uncompressed",
            param="content-encoding",
        )
    body = await request.body()
    try:
        return model.model_validate_json(body.removeprefix(UTF8_BOM))
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from None


def is_json_type(content_type: str) -> bool:
    """Whether a ``Content-Type`` value lets the body be read as JSON: empty (no header),
    ``application/json`` or ``application/<anything>+json``, with any parameters."""
    media = content_type.partition(";")[0].strip().lower()
    if not media:
        return not content_type.strip()  # no type at all; ";charset=utf-8" names none
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads ``model`` with ``parse_body``.

    The nested models are inlined: a ``$ref`` in an OpenAPI document resolves against
    the document, not against the schema's own ``$defs``.
    """
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _inline(schema, defs)}},
        }
    }


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node
