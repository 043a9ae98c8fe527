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

A ``\\u`` escape of a UTF-16 surrogate that is not half of a pair (``"\\ud800x"``) is
refused by pydantic-core's parser with a message about hex escapes that does not say
what is wrong ("unexpected end of hex escape", or "lone leading surrogate" for a lone
trailing one); the 400 names the escape and where it is instead.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from kvserve.openai.errors import OpenAIError

M = TypeVar("M", bound=BaseModel)
UTF8_BOM = b"\xef\xbb\xbf"
MAX_SHOWN = 100  # characters of a refused Content-Type the error repeats
# A JSON escape: ``\\uXXXX`` (its hex digits in group 1) or a one-character one. Scanned
# from the left, escapes are found exactly (``\\\\u…`` is an escaped backslash, then text).
ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.S)
HIGH_SURROGATES, LOW_SURROGATES = range(0xD800, 0xDC00), range(0xDC00, 0xE000)
UNPAIRED_HIGH = "a high surrogate must be followed at once by a low one (\\udc00-\\udfff)"
UNPAIRED_LOW = "a low surrogate must come right after a high one (\\ud800-\\udbff)"


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
    body = (await request.body()).removeprefix(UTF8_BOM)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        if errors and errors[0]["type"] == "json_invalid" and _about_escapes(errors[0]):
            lone = lone_surrogate(body)
            if lone is not None:
                errors[0]["ctx"] = {"error": lone}
        raise RequestValidationError(errors) from None


def lone_surrogate(body: bytes) -> str | None:
    """What is wrong with the first ``\\u`` escape of ``body`` that is a UTF-16 surrogate
    outside a pair (high, then at once low), with its line and column; None if none is."""
    pending: re.Match[bytes] | None = None  # a high surrogate waiting for its low half
    for escape in ESCAPE.finditer(body):
        code = int(escape[1], 16) if escape[1] is not None else None
        if pending is not None:
            if code in LOW_SURROGATES and escape.start() == pending.end():
                pending = None
                continue
            return _lone(body, pending, UNPAIRED_HIGH)
        if code in HIGH_SURROGATES:
            pending = escape
        elif code in LOW_SURROGATES:
            return _lone(body, escape, UNPAIRED_LOW)
    if pending is not None:
        return _lone(body, pending, UNPAIRED_HIGH)
    return None


def _about_escapes(error: Any) -> bool:
    """Whether pydantic-core's JSON error is one a lone surrogate causes (and not, say, a
    syntax error before it)."""
    text = str(error.get("ctx", {}).get("error", ""))
    return "hex escape" in text or "surrogate" in text


def _lone(body: bytes, escape: re.Match[bytes], why: str) -> str:
    before = body[: escape.start()]
    line = before.count(b"\n") + 1
    column = len(before[before.rfind(b"\n") + 1 :].decode(errors="replace")) + 1
    shown = escape[0].decode().lower()
    return f"lone surrogate {shown} at line {line} column {column}: {why}"


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
