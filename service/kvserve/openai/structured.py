"""The request fields that constrain the output, as ``StructuredOutputsParams``.

OpenAI's ``response_format`` (chat) and vLLM's ``structured_outputs`` (chat and
completions) map onto the engine's one constraint type. The constraint keeps the name of
the field it came from, so that an error found later (the engine's
``kvserve.structured.validate``, on this replica or behind the gateway) names what the
client sent: ``response_format.json_schema.schema``, ``structured_outputs``, ...
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import InvalidRequestError
from kvserve.openai.errors import OpenAIError
from kvserve.openai.protocol import ChatCompletionRequest, CommonRequest, StructuredOutputsRequest
from kvserve.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class Constraint:
    """An output constraint and the request field it came from (``param`` of errors)."""

    params: StructuredOutputsParams
    param: str


def requested_constraint(body: CommonRequest) -> Constraint | None:
    """The constraint the request asks for, or None; 400 naming the field if it is
    malformed or both fields are set."""
    response_format = body.response_format if isinstance(body, ChatCompletionRequest) else None
    fmt = None
    if response_format is not None and response_format.type != "text":
        fmt = _from_response_format(body)
    so = _from_structured_outputs(body.structured_outputs) if body.structured_outputs else None
    if fmt is not None and so is not None:
        raise OpenAIError(
            400,
            "set response_format or structured_outputs, not both",
            param="structured_outputs",
        )
    return fmt or so


def _from_response_format(body: CommonRequest) -> Constraint:
    assert isinstance(body, ChatCompletionRequest) and body.response_format is not None
    rf = body.response_format
    if rf.type == "json_object":
        return Constraint(StructuredOutputsParams(json_object=True), "response_format")
    if rf.json_schema is None:
        raise OpenAIError(
            400,
            'response_format of type "json_schema" needs json_schema',
            param="response_format.json_schema",
        )
    if rf.json_schema.schema_ is None:
        # OpenAI's default: any JSON object (the schema is optional in its API).
        return Constraint(StructuredOutputsParams(json_object=True), "response_format")
    return Constraint(
        StructuredOutputsParams(json=rf.json_schema.schema_),
        "response_format.json_schema.schema",
    )


def _from_structured_outputs(so: StructuredOutputsRequest) -> Constraint:
    try:
        params = StructuredOutputsParams(
            json=so.json_,
            json_object=bool(so.json_object),
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
        )
    except InvalidRequestError as exc:
        raise OpenAIError(400, str(exc), param="structured_outputs") from None
    return Constraint(params, "structured_outputs")


def renamed(exc: InvalidRequestError, param: str) -> OpenAIError:
    """A constraint's validation error as a 400 naming the client's field."""
    return OpenAIError(400, f"{param}: {exc}", param=param)
