"""Tools, structured outputs and reasoning through the gateway: the gateway passes them to
a replica over gRPC and formats what the replica's parsers read, parsing nothing itself.
The official ``openai`` SDK is the client; the replica is a ``kvserve serve`` process with
a random-weight model whose chat template renders tools in the Hermes style."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvserve.testing.checkpoints import build_random_checkpoint
from tests.support.checkpoints import TOOLS_CHECKPOINT
from tests.support.gateway import KEY_A, KEY_LIMITED, Gateway, start_gateway
from tests.support.replicas import REPLICA_MODEL as MODEL
from tests.support.replicas import Replica, start_replicas
from tests.support.tool_streams import streamed_in_pieces

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
]
QUESTION: list[Any] = [{"role": "user", "content": "Weather in Oslo for three days?"}]
FORCED: dict[str, Any] = {
    "model": MODEL,
    "messages": QUESTION,
    "tools": TOOLS,
    "tool_choice": "required",
}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    kwargs = dict(TOOLS_CHECKPOINT)
    arch = str(kwargs.pop("arch"))
    return build_random_checkpoint(tmp_path_factory.mktemp("tools"), arch, **kwargs)  # type: ignore[arg-type]


def gateway_over(tools_model: Path, *replica_args: str) -> Iterator[Gateway]:
    replicas: list[Replica] = start_replicas(tools_model, 1, *replica_args)
    gw = start_gateway(replicas, max_tokens_ceiling=1000)
    yield gw
    gw.stop()
    for rep in replicas:
        rep.stop()


@pytest.fixture(scope="module")
def tools_gateway(tools_model: Path) -> Iterator[Gateway]:
    # The tool parser is detected from the template. No reasoning parser: with one, a
    # constraint lets a think block of free text come first, which a random-weight model
    # may not close.
    yield from gateway_over(tools_model)


@pytest.fixture(scope="module")
def reasoning_gateway(tools_model: Path) -> Iterator[Gateway]:
    yield from gateway_over(tools_model, "--reasoning-parser", "qwen3")


def sdk(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY_A, max_retries=0)


def streamed_calls(client: openai.OpenAI, **request: Any) -> tuple[list[tuple[str, str]], str]:
    calls: dict[int, list[str]] = {}
    finish = ""
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:
                assert d.id and d.function and d.function.name
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += (d.function and d.function.arguments) or ""
        finish = choice.finish_reason or finish
    return [(name, args) for name, args in (calls[i] for i in sorted(calls))], finish


def test_tool_calls_round_trip(tools_gateway: Gateway) -> None:
    """A forced call, whole and streamed (they agree), then the call and its result sent
    back as a conversation, answered as text."""
    client = sdk(tools_gateway)
    request: dict[str, Any] = dict(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=4,
        max_tokens=200,
    )
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), PARAMETERS)
    assert streamed_calls(client, **request) == (
        [(calls[0].function.name, calls[0].function.arguments)],
        "tool_calls",
    )
    conversation = [
        *QUESTION,
        choice.message,
        {"role": "tool", "tool_call_id": calls[0].id, "content": "snow, -3 C"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, max_tokens=6, temperature=0
    ).choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    # The same call cut short inside its arguments (max_tokens): they are not JSON, and the
    # conversation holding it still goes on, through the gateway's gRPC call too.
    whole = client.chat.completions.create(**request)
    assert whole.usage is not None
    arguments = calls[0].function.arguments
    cut = whole.usage.completion_tokens - 5 - len(arguments) // 2
    short = client.chat.completions.create(**{**request, "max_tokens": cut}).choices[0]
    (partial,) = short.message.tool_calls or []
    assert short.finish_reason == "length", short
    assert (
        arguments.startswith(partial.function.arguments) and partial.function.arguments != arguments
    )
    conversation = [
        *QUESTION,
        short.message,
        {"role": "tool", "tool_call_id": partial.id, "content": "error: incomplete arguments"},
    ]
    again = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=2)
    assert again.choices[0].finish_reason in ("stop", "length")


def test_a_named_function_call_finishes_with_stop(tools_gateway: Gateway) -> None:
    """As OpenAI's API and vLLM: the call of a function the request named ends with
    finish_reason "stop", whole and streamed (the replica's reader decides it)."""
    client = sdk(tools_gateway)
    request: dict[str, Any] = {
        **FORCED,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "seed": 3,
        "max_tokens": 200,
    }
    choice = client.chat.completions.create(**request).choices[0]
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)
    assert streamed_calls(client, **request) == (
        [(call.function.name, call.function.arguments)],
        "stop",
    )


def test_forced_calls_stream_argument_by_argument(tools_gateway: Gateway) -> None:
    """The replica's call deltas reach the client as they are generated: a header, then
    the arguments in pieces, which put together are the whole answer's."""
    request = {**FORCED, "seed": 4, "temperature": 1.0, "max_tokens": 200}
    streamed_in_pieces(sdk(tools_gateway), request)


class Forecast(BaseModel):
    # Bounded values: a random-weight model's answer always fits in max_tokens.
    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)


def test_response_format_through_the_gateway(tools_gateway: Gateway) -> None:
    client = sdk(tools_gateway)
    answer = client.chat.completions.parse(
        model=MODEL, messages=QUESTION, response_format=Forecast, max_tokens=300, seed=1
    )
    assert isinstance(answer.choices[0].message.parsed, Forecast)
    with pytest.raises(openai.BadRequestError) as refused:  # found by the replica
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": 1}},
            },
        )
    assert refused.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]


def test_reasoning_deltas_through_the_gateway(reasoning_gateway: Gateway) -> None:
    client = sdk(reasoning_gateway)
    request: dict[str, Any] = dict(
        model=MODEL,
        messages=QUESTION,
        max_tokens=100,
        seed=2,
        extra_body={"structured_outputs": {"regex": "<think>[a-z ]{5,30}</think>[a-z ]{1,12}"}},
    )
    response = client.chat.completions.create(**request, n=2)
    whole = response.choices[0].message
    reasoning = whole.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and "think>" not in reasoning + (whole.content or "")
    assert whole.reasoning == reasoning  # type: ignore[attr-defined]  # vLLM's name
    # Both samples reasoned: the usage sums their think blocks' tokens, as the replica
    # counted them.
    assert response.usage is not None and response.usage.completion_tokens_details is not None
    both = response.usage.completion_tokens_details.reasoning_tokens
    assert both is not None and 2 <= both < response.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **request
        )
    )
    one = chunks[-1].usage
    assert one is not None and one.completion_tokens_details is not None
    assert 0 < (one.completion_tokens_details.reasoning_tokens or 0) < one.completion_tokens
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == whole.content
    assert sum(bool(getattr(d, "reasoning_content", None)) for d in deltas) > 1
    assert all(
        getattr(d, "reasoning", None) == getattr(d, "reasoning_content", None) for d in deltas
    )


def test_bad_input_is_refused_by_field(tools_gateway: Gateway) -> None:
    client = sdk(tools_gateway)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),  # by the gateway
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        (
            {"tools": [{"type": "function",
                        "function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "tools[0].function.parameters",  # by the gateway: not an object's schema
        ),
        (  # an integer llguidance cannot read: it was a 400 without its field
            {"tools": [{"type": "function",
                        "function": {"name": "f", "parameters": {"const": 2**70}}}]},
            "tools[0].function.parameters",
        ),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"const": 2**70}}}},
         "response_format.json_schema.schema"),
    ]  # fmt: skip
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=QUESTION, **extra)
        assert refused.value.body["param"] == param  # type: ignore[index]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=image)  # type: ignore[arg-type]
    assert refused.value.body["param"] == "messages[0].content[0]"  # type: ignore[index]
    # chat_template_kwargs travel to the replica, which renders the template and refuses
    # a client's own template (without the field the gateway dropped them: a 200).
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"chat_template": "{{ 'mine' }}"}},
        )
    assert refused.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
    assert "may not set 'chat_template'" in refused.value.body["message"]  # type: ignore[index]
    # A variable the template fails on ("..." + eos_token with eos_token 5: a TypeError in
    # Jinja) is the request's fault: a 400, and the replica stays in rotation for the
    # next request (it was marked unhealthy, so that request got a 503).
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"eos_token": 5}},
        )
    assert refused.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
    assert "TypeError" in refused.value.body["message"]  # type: ignore[index]
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)


def test_chat_endings_reach_the_replica(tools_gateway: Gateway) -> None:
    """vLLM's add_generation_prompt and continue_final_message travel to the replica,
    which renders the prompt (without the proto's field: three equal prompts)."""
    client = sdk(tools_gateway)
    messages = [*QUESTION, {"role": "assistant", "content": "Sunny in"}]

    def prompt_tokens(**extra: Any) -> int:
        done = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=1,
            extra_body=extra,  # type: ignore[arg-type]
        )
        assert done.usage is not None
        return done.usage.prompt_tokens

    endings = [
        prompt_tokens(),
        prompt_tokens(add_generation_prompt=False),
        prompt_tokens(add_generation_prompt=False, continue_final_message=True),
    ]
    assert len(set(endings)) == 3, endings
    with pytest.raises(openai.BadRequestError) as refused:  # refused by the gateway
        prompt_tokens(continue_final_message=True)
    assert refused.value.body["param"] == "continue_final_message"  # type: ignore[index]


def test_tool_schemas_count_in_the_token_estimate(tools_gateway: Gateway) -> None:
    """A tenant's token budget (400 a minute here) is charged for the tools the template
    renders, not only for the messages: the same tiny chat is admitted without a long
    tool and refused, before any replica sees it, with one."""
    limited = openai.OpenAI(base_url=f"{tools_gateway.url}/v1", api_key=KEY_LIMITED, max_retries=0)
    chat: dict[str, Any] = dict(model=MODEL, messages=QUESTION, max_tokens=1)
    limited.chat.completions.create(**chat)  # ~20 tokens: admitted
    long_tool = {
        "type": "function",
        "function": {
            "name": "describe",
            "description": "a tool with a long description " * 150,  # ~4,700 characters
            "parameters": {"type": "object", "properties": {}},
        },
    }
    with pytest.raises(openai.BadRequestError) as refused:
        limited.chat.completions.create(**chat, tools=[long_tool], tool_choice="none")
    message = refused.value.body["message"]  # type: ignore[index]
    assert refused.value.status_code == 400 and "tokens" in message, message
