"""Schema-driven fuzzing of a live server's OpenAPI document (schemathesis), shared by the
engine server's and the gateway's fuzz tests.

schemathesis' own pytest integration (``from_fixture`` / ``@schema.parametrize()``) needs
the schema at collection time or breaks on pytest 9 (it rewrites ``node._nodeid``), so
``fuzz_operation`` runs each operation's Hypothesis strategy with ``@given`` inside an
ordinary test.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

ERROR_FIELDS = {"message", "type", "param", "code", "request_id"}


def openai_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx carries {"error": {"message", "type", "param", "code", "request_id"}}."""
    if not 400 <= response.status_code < 500:
        return None
    try:
        body = response.json()
    except ValueError as exc:
        raise AssertionError(
            f"{response.status_code} with a non-JSON body: {response.text[:300]!r}"
        ) from exc
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict) and set(error) == ERROR_FIELDS, (
        f"{response.status_code} body is not an OpenAI error object: {body!r}"
    )
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    return None


def cases(operation: Any, model: str) -> Any:
    """Valid and invalid requests; bodies also with ``model``, the served model's name (a
    random name is refused before anything else is looked at)."""

    def name_the_model(case: Any) -> Any:
        if isinstance(case.body, dict):
            case.body = {**case.body, "model": model}
        return case

    if operation.body:
        variants = [
            operation.as_strategy(mode)
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        ]
        return st.one_of(*variants, *(v.map(name_the_model) for v in variants))
    return operation.as_strategy(GenerationMode.POSITIVE)


def fuzz_operation(
    schema: Any,
    label: str,
    base_url: str,
    model: str,
    max_examples: int,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Send ``max_examples`` generated requests to one operation: never a 5xx, and every
    4xx an OpenAI error object."""
    operation = schema.find_operation_by_label(label)
    assert operation is not None, label

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases(operation, model))
    def fuzz(case: Any) -> None:
        case.call_and_validate(
            base_url=base_url,
            headers=dict(headers or {}),
            checks=[not_a_server_error, openai_error_shape],
            timeout=30,
        )

    fuzz()
