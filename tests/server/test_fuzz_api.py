"""Property-based fuzzing of the live server's OpenAPI schema with schemathesis.

Every operation the app publishes (completions, chat, models, health, readiness, metrics)
gets schema-driven requests, valid ones and invalid ones. Whatever arrives, the server
must not answer 5xx, and every 4xx must be an OpenAI error object.

A random ``"model"`` is refused (404) before anything else is looked at, so about half of
the bodies name the served model and reach validation and the engine. The server runs
with a small ``max_model_len``: an accepted request generates at most that many tokens,
and a larger ``max_tokens`` must be refused with a 4xx, which the fuzzer also exercises.

The fuzzing itself is ``tests.support.openapi_fuzz``; tests/gateway/test_fuzz_gateway.py
runs the same against the gateway, with real replicas behind it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis

from tests.support.engine_server import SERVED_MODEL as MODEL
from tests.support.engine_server import RunningServer, start_server, stop_server
from tests.support.openapi_fuzz import ERROR_FIELDS, fuzz_operation

MAX_MODEL_LEN = 96
MAX_EXAMPLES = 30
OPERATIONS = [
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "GET /health",
    "GET /ready",
    "GET /metrics",
]


@pytest.fixture(scope="module")
def fuzz_server(checkpoint_dir) -> Iterator[RunningServer]:  # type: ignore[no-untyped-def]
    srv = start_server(checkpoint_dir("llama"), block_size=4, max_model_len=MAX_MODEL_LEN)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: RunningServer) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", timeout=30)


def assert_openai_error(response: httpx.Response) -> None:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


# Requests the schema-driven fuzzer cannot produce: bytes that are not JSON, JSON that is
# not an object, other media types and methods, and lone UTF-16 surrogates (the fuzzer
# generates UTF-8-encodable strings only).
RAW_REQUESTS = [
    pytest.param("POST", "/v1/completions", b"\xff\xfe", "application/json", id="not-utf8"),
    pytest.param("POST", "/v1/completions", b'{"model": ', "application/json", id="truncated"),
    pytest.param("POST", "/v1/completions", b"[]", "application/json", id="array"),
    pytest.param("POST", "/v1/completions", b"null", "application/json", id="null"),
    pytest.param("POST", "/v1/completions", b"prompt=hi", "text/plain", id="text-plain"),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"model": "tiny-llama", "prompt": "hi", "temperature": NaN}',
        "application/json",
        id="nan",
    ),
    pytest.param("PUT", "/v1/completions", b"{}", "application/json", id="wrong-method"),
    pytest.param("GET", "/v1/nothing-here", b"", "application/json", id="unknown-path"),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"model": "tiny-llama", "prompt": "\\ud800", "max_tokens": 2}',
        "application/json",
        id="lone-surrogate-prompt",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\udc00"}], '
        b'"max_tokens": 2}',
        "application/json",
        id="lone-surrogate-chat",
    ),
]


@pytest.mark.parametrize(("method", "path", "body", "content_type"), RAW_REQUESTS)
def test_malformed_requests_get_openai_4xx(
    method: str, path: str, body: bytes, content_type: str, fuzz_server: RunningServer
) -> None:
    # A fresh connection each time: a 500 that escapes the app also drops the connection.
    with fuzz_server.client() as c:
        r = c.request(method, path, content=body, headers={"content-type": content_type})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert_openai_error(r)


def test_the_schema_publishes_exactly_the_fuzzed_operations(api_schema: Any) -> None:
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert labels == set(OPERATIONS)


@pytest.mark.slow
@pytest.mark.parametrize("label", OPERATIONS)
def test_no_server_errors_and_openai_errors(
    label: str, api_schema: Any, fuzz_server: RunningServer
) -> None:
    fuzz_operation(api_schema, label, fuzz_server.url, MODEL, MAX_EXAMPLES)
