"""Content parts, tool calling, structured-output fields and reasoning on a real engine
server, with the official ``openai`` SDK as the client.

The model has random weights, so a call is only ever made when a grammar forces it
(``tool_choice`` "required" or a named function); that is the contract under test: the
call then always parses and its arguments validate. Its chat template renders tools in
the Hermes style, so the server picks the hermes parser by itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import grpc
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvserve.openai import format as fmt
from kvserve.openai.chat_output import ChatParsing
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from kvserve.testing.checkpoints import build_random_checkpoint
from tests.support.checkpoints import TOOLS_CHECKPOINT
from tests.support.engine_server import SERVED_MODEL as MODEL
from tests.support.engine_server import RunningServer, start_server, stop_server
from tests.support.tool_streams import streamed_in_pieces

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The forecast for a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
                # Bounded, so a random model's call always fits in max_tokens.
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris this week?"}]
FORCED: dict[str, Any] = {
    "model": MODEL,
    "messages": QUESTION,
    "tools": TOOLS,
    "tool_choice": "required",
}


def _tools_checkpoint(tmp_path_factory: pytest.TempPathFactory, **changes: Any) -> Any:
    kwargs = {**TOOLS_CHECKPOINT, **changes}
    arch = str(kwargs.pop("arch"))
    return build_random_checkpoint(tmp_path_factory.mktemp("tools"), arch, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _tools_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def tools_server(tools_model: Any) -> Iterator[RunningServer]:
    # The tool parser is left to detection (the template names <tool_call>). No reasoning
    # parser: with one, a constraint lets a think block of free text come first, which a
    # random-weight model may not close.
    srv = start_server(
        tools_model, block_size=4, chat_parsing=_detected(tools_model, None), grpc=True
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def reasoning_server(tools_model: Any) -> Iterator[RunningServer]:
    srv = start_server(tools_model, block_size=4, chat_parsing=_detected(tools_model, "qwen3"))
    yield srv
    stop_server(srv)


def _detected(path: Any, reasoning: str | None) -> ChatParsing:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    parsing = ChatParsing.for_model(None, reasoning, tokenizer.chat_template, tokenizer)
    assert parsing.tool_parser == "hermes"
    return parsing


def sdk(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def refusal(srv: RunningServer, body: dict[str, Any]) -> dict[str, Any]:
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    return error


# ---- messages ------------------------------------------------------------------------
def test_text_parts_are_the_same_prompt_as_a_string(tools_server: RunningServer) -> None:
    client = sdk(tools_server)
    as_parts = [
        {"type": "text", "text": "What is the weather"},
        {"type": "text", "text": "in Paris?"},
    ]
    answers = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
            max_tokens=6,
            temperature=0,
        )
        for content in (as_parts, "What is the weather\nin Paris?")
    ]
    usages = [a.usage for a in answers]
    assert usages[0] and usages[1] and usages[0].prompt_tokens == usages[1].prompt_tokens
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


def test_an_assistants_refusal_is_its_text(tools_server: RunningServer) -> None:
    """OpenAI's refusal, sent back in a conversation as a refusal part or as the SDK's
    message (content null, ``refusal`` set), is what the assistant said."""
    said = "I cannot help with that."
    forms: list[dict[str, Any]] = [
        {"role": "assistant", "content": said},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": said}]},
        {"role": "assistant", "content": None, "refusal": said},
    ]
    with tools_server.client() as c:
        usages = []
        for reply in forms:
            messages = [*QUESTION, reply, {"role": "user", "content": "Why?"}]
            body = {"model": MODEL, "max_tokens": 1, "messages": messages}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"]["prompt_tokens"])
    assert usages[0] == usages[1] == usages[2]
    user_refusal = [{"role": "user", "content": [{"type": "refusal", "refusal": said}]}]
    error = refusal(tools_server, {"messages": user_refusal})
    assert error["param"] == "messages[0].content[0]"


@pytest.mark.parametrize(
    ("part", "kind"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "image_url"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
        ({"type": "file", "file": {"file_id": "file-1"}}, "file"),
    ],
)
def test_non_text_parts_are_refused_by_path(
    tools_server: RunningServer, part: dict[str, Any], kind: str
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]},
    ]
    error = refusal(tools_server, {"messages": messages})
    assert error["param"] == "messages[1].content[1]"
    assert kind in error["message"] and "text only" in error["message"]


def test_null_content_only_for_an_assistant_with_tool_calls(tools_server: RunningServer) -> None:
    error = refusal(tools_server, {"messages": [{"role": "user", "content": None}]})
    assert error["param"] == "messages[0].content"
    error = refusal(tools_server, {"messages": [{"role": "user", "content": []}]})
    assert error["param"] == "messages[0].content" and "empty array" in error["message"]
    no_id = [*QUESTION, {"role": "tool", "content": "sunny"}]
    assert refusal(tools_server, {"messages": no_id})["param"] == "messages[1].tool_call_id"


def test_a_call_whose_arguments_are_not_an_object_goes_back_as_written(
    tools_server: RunningServer,
) -> None:
    """A call cut short by max_tokens has arguments that are not JSON: sent back in the
    conversation (as agent frameworks do, with an error as the tool's result), its text
    reaches the template as it was written (it was a 400 that ended the conversation).
    So do arguments nested too deeply for json's parser (its RecursionError was a 500)."""
    with tools_server.client() as c:
        usages = []
        for arguments in ('{"city": "Paris"}', '{"city": "Par', "[1", "[" * 1500):
            call = {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
            messages = [
                *QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "error: bad arguments"},
            ]
            body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 1}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"]["prompt_tokens"])
    assert usages[2] < usages[1]  # each text reaches the template as written


# ---- bad tools ------------------------------------------------------------------------
def test_bad_tool_requests_name_their_field(tools_server: RunningServer) -> None:
    twice = {"messages": QUESTION, "tools": [TOOLS[0], TOOLS[0]]}
    assert refusal(tools_server, twice)["param"] == "tools"
    unknown = {
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_moon"}},
    }
    error = refusal(tools_server, unknown)
    assert error["param"] == "tool_choice" and "get_moon" in error["message"]
    required = {"messages": QUESTION, "tool_choice": "required"}
    assert refusal(tools_server, required)["param"] == "tool_choice"
    bad_schema = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": 3}},
    }
    body = {"messages": QUESTION, "tools": [TOOLS[0], bad_schema]}
    assert refusal(tools_server, body)["param"] == "tools[1].function.parameters"
    # A function's arguments are an object: a forced call under another schema would be
    # a string, a list or a number, which clients cannot pass as keyword arguments.
    for kind in ("string", "array", "integer", ["object", "null"]):
        not_object = {"type": "function", "function": {"name": "f", "parameters": {"type": kind}}}
        body = {"messages": QUESTION, "tools": [not_object], "tool_choice": "required"}
        error = refusal(tools_server, body)
        assert error["param"] == "tools[0].function.parameters", error
        assert "JSON schema of an object" in error["message"]


def test_a_function_without_parameters_is_called_with_none(tools_server: RunningServer) -> None:
    """OpenAI's "empty parameter list": a forced call's arguments are {}."""
    bare = {"type": "function", "function": {"name": "get_time"}}
    with tools_server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": QUESTION,
                "tools": [bare],
                "tool_choice": "required",
                "max_tokens": 40,
            },
        )
    assert r.status_code == 200, r.text
    [call] = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {}


def test_tools_for_a_model_without_a_tool_parser(server: RunningServer) -> None:
    # The tests' plain checkpoint: its chat template names no call format.
    error = refusal(server, {"messages": QUESTION, "tools": TOOLS})
    assert error["param"] == "tools" and "--tool-call-parser" in error["message"]
    with server.client() as c:  # offered but not to be called: rendered, no parser needed
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": QUESTION,
                "tools": TOOLS,
                "tool_choice": "none",
                "max_tokens": 2,
            },
        )
    assert r.status_code == 200, r.text


# ---- tool calls --------------------------------------------------------------------------
def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_required_calls_always_parse_and_validate(tools_server: RunningServer) -> None:
    client = sdk(tools_server)
    for seed in range(6):
        parallel = seed % 2 == 0
        answer = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,  # type: ignore[arg-type]
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            temperature=1.0,
            seed=seed,
            max_tokens=300,
        )
        choice = answer.choices[0]
        assert choice.message.tool_calls, choice
        calls = choice.message.tool_calls
        if parallel:
            # A random model may go on calling until max_tokens: the call cut short then
            # keeps what was streamed of it (OpenAI's API does the same), and the finish
            # reason "length" says so.
            assert choice.finish_reason in ("tool_calls", "length")
            if choice.finish_reason == "length":
                calls = calls[:-1]
        else:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None and len(choice.message.tool_calls) == 1
        for call in calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function_is_the_one_called(tools_server: RunningServer) -> None:
    """The call of a named function ends with finish_reason "stop", whole and streamed, as
    in OpenAI's API and vLLM ("tool_calls" is for calls the model chose to make)."""
    client = sdk(tools_server)
    request: dict[str, Any] = dict(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        seed=3,
        max_tokens=300,
    )
    answer = client.chat.completions.create(**request)
    calls = _calls(answer.choices[0].message)
    assert [name for name, _ in calls] == ["get_time"]
    jsonschema.validate(calls[0][1], SCHEMAS["get_time"])
    assert answer.choices[0].finish_reason == "stop"
    whole = answer.choices[0].message.tool_calls or []
    assert _streamed(client, **request) == (
        "",
        [(c.function.name, c.function.arguments) for c in whole],
        "stop",
    )


def _streamed(client: openai.OpenAI, **request: Any) -> tuple[str, list[tuple[str, str]], str]:
    """Content, calls (name, arguments) and finish reason of a streamed answer, put
    together as an SDK user does; each call's first delta carries its id and name."""
    content, calls, finish = "", {}, ""
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:
                assert d.id and d.id.startswith("call_") and d.type == "function"
                assert d.function and d.function.name
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None
            calls[d.index][1] += (d.function and d.function.arguments) or ""
        finish = choice.finish_reason or finish
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], finish


@pytest.mark.parametrize("parallel", [False, True])
def test_without_a_grammar_parallel_false_keeps_the_first_call(
    tools_server: RunningServer, parallel: bool
) -> None:
    """Under "auto" nothing holds the model to one call: when it writes two anyway,
    ``parallel_tool_calls: false`` keeps the first, whole and streamed. (A regex makes
    this random model write the two.)"""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "%s"}}\n</tool_call>'
    two = f"{call % 'UTC'}\n{call % 'CET'}"
    request: dict[str, Any] = dict(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="auto", max_tokens=400,
        parallel_tool_calls=parallel, extra_body={"structured_outputs": {"regex": re.escape(two)}},
    )  # fmt: skip
    client = sdk(tools_server)
    choice = client.chat.completions.create(**request).choices[0]
    whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    _, streamed, finish = _streamed(client, **request)
    expected = [("get_time", '{"zone": "UTC"}'), ("get_time", '{"zone": "CET"}')]
    assert whole == streamed == (expected if parallel else expected[:1])
    assert choice.finish_reason == finish == "tool_calls"
    assert not choice.message.content


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streaming_and_whole_answers_agree(tools_server: RunningServer, tool_choice: str) -> None:
    client = sdk(tools_server)
    request = dict(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice=tool_choice,
        seed=11,
        temperature=1.0,
        max_tokens=120,
    )
    whole = client.chat.completions.create(**request).choices[0]  # type: ignore[call-overload]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    streamed = _streamed(client, **request)
    assert streamed == (whole.message.content or "", calls, whole.finish_reason)


def test_n_answers_are_each_read_by_a_parser_of_their_own(tools_server: RunningServer) -> None:
    """With ``n``, every choice's calls are read from its own text: choice i is the answer
    the same request alone with seed + i gets, whole and streamed."""
    client = sdk(tools_server)
    request: dict[str, Any] = dict(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=1.0,
        max_tokens=120,
    )  # fmt: skip

    def calls(choice: Any) -> tuple[list[tuple[str, str]], str]:
        found = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return found, choice.finish_reason

    whole = client.chat.completions.create(**request, n=3, seed=11)
    alone = [client.chat.completions.create(**request, seed=11 + i) for i in range(3)]
    assert [calls(c) for c in whole.choices] == [calls(a.choices[0]) for a in alone]
    streamed: list[dict[int, list[str]]] = [{}, {}, {}]
    finishes = ["", "", ""]
    for chunk in client.chat.completions.create(**request, n=3, seed=11, stream=True):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or ():
                call = streamed[choice.index].setdefault(d.index, ["", ""])
                call[0] += (d.function and d.function.name) or ""
                call[1] += (d.function and d.function.arguments) or ""
            finishes[choice.index] += choice.finish_reason or ""
    joined = [([(n, a) for n, a in s.values()], f) for s, f in zip(streamed, finishes, strict=True)]
    assert joined == [calls(c) for c in whole.choices]


def test_forced_calls_stream_argument_by_argument(tools_server: RunningServer) -> None:
    """OpenAI's streaming shape: a call's first delta carries index, id, type and name;
    later ones append to its arguments, which arrive in pieces as they are generated.
    Put together, they are the whole answer's calls."""
    request = {**FORCED, "seed": 7, "temperature": 1.0, "max_tokens": 300}
    calls, finish = streamed_in_pieces(sdk(tools_server), request)
    assert len(calls) > 1  # parallel calls, their indexes in order
    # max_tokens may cut the last call short (its arguments then incomplete).
    for call in calls[:-1] if finish == "length" else calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("pieces", [False, True])
def test_grpc_sends_calls_in_pieces_only_to_a_client_that_reads_them(
    tools_server: RunningServer, pieces: bool
) -> None:
    """Wire compatibility within a release: a gateway from before piecewise calls takes
    each ToolCallDelta for a whole call, so a replica sends pieces only when the request
    sets tool_call_pieces (as this release's gateway does). Either way the calls are the
    same."""
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content=QUESTION[0]["content"])]
        ),
        tools=[
            pb.Tool(
                name=t["function"]["name"], parameters_json=json.dumps(t["function"]["parameters"])
            )
            for t in TOOLS
        ],
        tool_choice=pb.ToolChoice(mode="required"),
        max_tokens=300,
        seed=7,
        temperature=1.0,
        tool_call_pieces=pieces,
    )
    with grpc.insecure_channel(f"127.0.0.1:{tools_server.grpc_port}") as channel:
        responses = list(pb_grpc.EngineServiceStub(channel).Generate(request, timeout=120))
    deltas = [d for r in responses if r.HasField("delta") for d in r.delta.tool_calls]
    headers = [d for d in deltas if d.call.id]
    if pieces:
        assert len(deltas) > len(headers)  # arguments arrived in pieces after the headers
    else:
        assert deltas == headers  # every delta is a whole call: id, name, all arguments
    joined = fmt.joined_calls(
        [
            fmt.ToolCallDelta(d.index, d.call.arguments, d.call.id or None, d.call.name or None)
            for d in deltas
        ]
    )
    assert len(joined) == len(headers) > 1
    finish = next(r.final.finish_reason for r in responses if r.HasField("final"))
    for call in joined[:-1] if finish == "length" else joined:
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
        )


def test_a_tool_without_parameters_is_the_same_over_grpc_and_http(
    tools_server: RunningServer,
) -> None:
    """A tool without ``parameters`` takes none over HTTP; over gRPC the field is an
    empty string then (proto3's unset), which was once refused as not a JSON object."""
    forced = {"seed": 3, "temperature": 1.0, "max_tokens": 60}
    body = {"model": MODEL, "messages": QUESTION, **forced,
            "tools": [{"type": "function", "function": {"name": "ping"}}],
            "tool_choice": {"type": "function", "function": {"name": "ping"}}}  # fmt: skip
    with tools_server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (http_call,) = r.json()["choices"][0]["message"]["tool_calls"]
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content=QUESTION[0]["content"])]
        ),
        tools=[pb.Tool(name="ping")],
        tool_choice=pb.ToolChoice(mode="function", function="ping"),
        **forced,
    )
    with grpc.insecure_channel(f"127.0.0.1:{tools_server.grpc_port}") as channel:
        responses = list(pb_grpc.EngineServiceStub(channel).Generate(request, timeout=120))
    calls = [d.call for r in responses if r.HasField("delta") for d in r.delta.tool_calls]
    assert [(c.name, c.arguments) for c in calls] == [("ping", http_call["function"]["arguments"])]


@pytest.mark.parametrize("replay", ["message objects", "streamed", "dumped"])
def test_a_tool_loop_over_several_turns(tools_server: RunningServer, replay: str) -> None:
    """call → tool result → call → tool result → answer, the conversation growing as an
    agent grows it: the SDK's own message objects sent back, the calls gathered from a
    stream, or the messages as ``model_dump()`` stores them, with every unset field null
    (``audio``, ``function_call``, ``annotations``, ``refusal``)."""
    client = sdk(tools_server)
    messages: list[Any] = list(QUESTION)
    for turn in range(2):
        request = dict(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            seed=turn,
            max_tokens=150,
        )
        if replay == "streamed":
            _, calls, finish = _streamed(client, **request)
            assert finish == "tool_calls"
            assistant: Any = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{turn}_{i}",
                        "type": "function",
                        "function": {"name": n, "arguments": a},
                    }
                    for i, (n, a) in enumerate(calls)
                ],
            }
            ids = [c["id"] for c in assistant["tool_calls"]]
        else:
            choice = client.chat.completions.create(**request).choices[0]  # type: ignore[call-overload]
            assert choice.finish_reason == "tool_calls", choice
            message = choice.message
            assistant = message.model_dump() if replay == "dumped" else message
            ids = [c.id for c in message.tool_calls or ()]
        assert ids
        messages.append(assistant)
        messages += [{"role": "tool", "tool_call_id": i, "content": "sunny, 21 C"} for i in ids]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    ).choices[0]
    assert final.finish_reason in ("stop", "length") and not final.message.tool_calls
    assert isinstance(final.message.content, str)


# ---- the mistral format, its marker a special token ------------------------------------
@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A random model whose tokenizer makes [TOOL_CALLS] a special token (as Mistral's
    do) and whose chat template names it: the server picks the mistral parser, and the
    grammar forces that token, which the answer's text leaves out."""
    path = _tools_checkpoint(tmp_path_factory, tokenizer="byte_level_mistral_tools")
    srv = start_server(path, block_size=4)
    tok = srv.engine.tokenizer
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert tok.decode([marker], skip_special_tokens=True) == ""
    yield srv
    stop_server(srv)


@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [
        ("required", False),
        ("required", True),
        ({"type": "function", "function": {"name": "get_time"}}, True),
    ],
)
def test_mistral_calls_through_its_grammar_parse_and_validate(
    mistral_server: RunningServer, tool_choice: Any, parallel: bool
) -> None:
    client = sdk(mistral_server)
    named = isinstance(tool_choice, dict)
    for seed in range(3):
        request = {**FORCED, "tool_choice": tool_choice, "parallel_tool_calls": parallel}
        request.update(temperature=1.0, seed=seed, max_tokens=300)
        choice = client.chat.completions.create(**request).choices[0]
        calls = choice.message.tool_calls or []
        assert calls, choice
        assert choice.message.content is None
        if choice.finish_reason == "length":  # parallel: cut short while calling on
            assert parallel
            calls = calls[:-1]
        else:  # a named function's call ends as OpenAI's does, with "stop"
            assert choice.finish_reason == ("stop" if named else "tool_calls"), choice
        if not parallel or named:
            assert len(choice.message.tool_calls or []) == 1
        if named:
            assert {c.function.name for c in calls} <= {"get_time"}
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert _streamed(client, **request) == ("", whole, choice.finish_reason)


def test_calls_read_the_same_when_the_text_keeps_special_tokens(
    mistral_server: RunningServer,
) -> None:
    """With skip_special_tokens false the answer's text holds the [TOOL_CALLS] token
    itself, so the reader must not put it back a second time."""
    client = sdk(mistral_server)
    request = {**FORCED, "temperature": 1.0, "seed": 0, "max_tokens": 300}
    kept = client.chat.completions.create(**request, extra_body={"skip_special_tokens": False})
    skipped = client.chat.completions.create(**request)
    calls = [
        (c.function.name, c.function.arguments) for c in skipped.choices[0].message.tool_calls or []
    ]
    assert calls
    assert [
        (c.function.name, c.function.arguments) for c in kept.choices[0].message.tool_calls or []
    ] == calls
    assert kept.choices[0].message.content is None


class Budget(BaseModel):
    amount: int = Field(ge=1, le=99)
    currency: Literal["EUR", "USD"]


class SearchHotels(BaseModel):
    city: Literal["Paris", "Oslo"]
    budget: Budget  # a nested model: pydantic writes it as a "$ref" into "$defs"


# Another tool whose "$defs" reuse the name "Budget" for another schema: in one grammar
# document (mistral's), each tool's references must keep to its own definitions. One of
# its properties is named "default", as a JSON Schema keyword is: its reference is one.
BOOK_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "book",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "nights": {"$ref": "#/$defs/Budget"},
                "default": {"$ref": "#/$defs/Budget"},
            },
            "required": ["nights", "default"],
            "additionalProperties": False,
            "$defs": {"Budget": {"type": "integer", "minimum": 1, "maximum": 9}},
        },
    },
}


@pytest.mark.parametrize("server_name", ["tools_server", "mistral_server"])
def test_tools_with_nested_models_are_called_through_their_grammar(
    server_name: str, request: pytest.FixtureRequest
) -> None:
    """``openai.pydantic_function_tool`` of a model with a nested model sends a strict
    tool whose schema refers to its "$defs": a forced call's grammar nests that schema,
    and the references must still resolve (they pointed at nothing: a 400)."""
    client = sdk(request.getfixturevalue(server_name))
    tools = [openai.pydantic_function_tool(SearchHotels), BOOK_TOOL]
    for seed in range(3):
        answer = client.chat.completions.parse(
            model=MODEL,
            messages=QUESTION,  # type: ignore[arg-type]
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=300,
        )
        (call,) = answer.choices[0].message.tool_calls or []
        if call.function.name == "SearchHotels":
            assert isinstance(call.function.parsed_arguments, SearchHotels)
        else:
            arguments = json.loads(call.function.arguments)
            for nights in (arguments["nights"], arguments["default"]):
                assert isinstance(nights, int) and 1 <= nights <= 9, call


# ---- structured outputs ----------------------------------------------------------------
class Forecast(BaseModel):
    # Bounded values: a random-weight model's answer always fits in max_tokens.
    city: Literal["Paris", "Oslo", "Rome"]
    days: int = Field(ge=1, le=7)
    rain: bool


def test_parse_returns_a_pydantic_object(tools_server: RunningServer) -> None:
    answer = sdk(tools_server).chat.completions.parse(
        model=MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        response_format=Forecast,
        max_tokens=400,
        seed=0,
    )
    parsed = answer.choices[0].message.parsed
    assert isinstance(parsed, Forecast)


def test_bad_constraints_name_their_field(tools_server: RunningServer) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    error = refusal(tools_server, {"messages": QUESTION, "response_format": bad_schema})
    assert error["param"] == "response_format.json_schema.schema"
    bad_regex = {"messages": QUESTION, "structured_outputs": {"regex": "(unclosed"}}
    assert refusal(tools_server, bad_regex)["param"] == "structured_outputs"
    both = {"messages": QUESTION, "structured_outputs": {"regex": "a", "choice": ["a"]}}
    assert refusal(tools_server, both)["param"] == "structured_outputs"
    with tools_server.client() as c:
        r = c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "(x"}},
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"


def test_a_constraint_that_matches_no_text_is_a_400_streamed_too(
    tools_server: RunningServer,
) -> None:
    """A schema that refers to itself and nothing else compiles, yet no token can begin
    it: found when its compile is awaited before the response starts, so a stream gets
    the 400 (it got a 200, then an error event)."""
    cycle = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}
    body = {"model": MODEL, "messages": QUESTION, "response_format": cycle, "max_tokens": 8}
    with tools_server.client() as c:
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "response_format.json_schema.schema", error
            assert "matches no text" in error["message"]


@pytest.mark.parametrize(
    ("schema", "what"),
    [
        ('{"const": 1180591620717411303424}', "not JSON serializable: 1180591620717411303424"),
        ('{"type": "integer", "maximum": 1e999}', "not finite"),
        ('{"properties": {"a": {"enum": [1, 18446744073709551616]}}}', "not JSON serializable"),
    ],
)
def test_numbers_llguidance_cannot_take_are_refused_by_field(
    tools_server: RunningServer, schema: str, what: str
) -> None:
    """An integer beyond 64 bits was a 500 (llguidance cannot read it), an infinite number
    (1e999) forced a null; each is now a 400 naming where the schema came in."""
    places = {
        "response_format.json_schema.schema": (
            "/v1/chat/completions",
            f'"messages": [{{"role": "user", "content": "hi"}}], "response_format": '
            f'{{"type": "json_schema", "json_schema": {{"name": "x", "schema": {schema}}}}}',
        ),
        "tools[0].function.parameters": (
            "/v1/chat/completions",
            '"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", '
            f'"tools": [{{"type": "function", "function": {{"name": "f", "parameters": '
            f'{{"type": "object", "properties": {{"x": {schema}}}}}}}}}]',
        ),
        "structured_outputs": (
            "/v1/completions",
            f'"prompt": "hi", "structured_outputs": {{"json": {schema}}}',
        ),
    }
    with tools_server.client() as c:
        for param, (path, fields) in places.items():
            body = f'{{"model": "{MODEL}", "max_tokens": 4, {fields}}}'
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (param, r.text)
            assert r.json()["error"]["param"] == param, r.text
            assert what in r.json()["error"]["message"], r.text


# Compiles, then grows past llguidance's limits on its first "a": the client's grammar.
EXPLODING_REGEX = "a{1000000}"


def test_a_grammar_that_fails_while_it_runs_is_the_clients_error(
    tools_server: RunningServer,
) -> None:
    """400 naming the field the constraint came in, on a whole answer, in a stream's error
    event and over gRPC (INVALID_ARGUMENT, which a gateway does not retry); it was 500."""
    exploding = {"structured_outputs": {"regex": EXPLODING_REGEX}}
    error = refusal(tools_server, {"messages": QUESTION, **exploding})
    assert error["param"] == "structured_outputs", error
    assert "too many expressions" in error["message"]
    schema = {"type": "string", "pattern": f"^{EXPLODING_REGEX}$"}
    in_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    error = refusal(tools_server, {"messages": QUESTION, "response_format": in_schema})
    assert error["param"] == "response_format.json_schema.schema", error
    body = {"model": MODEL, "messages": QUESTION, "stream": True, **exploding}
    with tools_server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert r.status_code == 200 and "error" in events[-1], r.text
    assert events[-1]["error"]["type"] == "invalid_request_error"
    assert events[-1]["error"]["param"] == "structured_outputs"
    request = pb.GenerateRequest(
        prompt_text="hi",
        max_tokens=8,
        structured_outputs=pb.StructuredOutputs(regex=EXPLODING_REGEX),
    )
    with (
        grpc.insecure_channel(f"127.0.0.1:{tools_server.grpc_port}") as channel,
        pytest.raises(grpc.RpcError) as failed,
    ):
        list(pb_grpc.EngineServiceStub(channel).Generate(request, timeout=120))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failed.value
    # The same grammar again fails the same way (its compiled copy, whose state the
    # failure spoiled, is not reused: it allowed only EOS, a silent empty answer).
    assert refusal(tools_server, {"messages": QUESTION, **exploding})["param"] == (
        "structured_outputs"
    )


def test_structured_outputs_on_completions(tools_server: RunningServer) -> None:
    answer = sdk(tools_server).completions.create(
        model=MODEL,
        prompt="Pick one:",
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert answer.choices[0].text in ("yes", "no")


# ---- reasoning ---------------------------------------------------------------------------
THINKING = "<think>[a-z ]{5,40}</think>[a-z ]{1,20}"


def test_reasoning_is_split_from_the_answer(reasoning_server: RunningServer) -> None:
    """The output is forced into a <think> block then an answer; "</think>" is several
    tokens here, so the stream sees it cut across deltas."""
    client = sdk(reasoning_server)
    request: dict[str, Any] = dict(
        model=MODEL,
        messages=QUESTION,
        max_tokens=100,
        seed=5,
        extra_body={"structured_outputs": {"regex": THINKING}},
    )
    response = client.chat.completions.create(**request, logprobs=True)
    whole = response.choices[0].message
    reasoning = whole.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and "<think>" not in reasoning and "</think>" not in (whole.content or "")
    assert whole.reasoning == reasoning  # type: ignore[attr-defined]  # vLLM's name
    # The usage counts the think block's tokens, up to the one that completes "</think>".
    tokens = [entry.token for entry in response.choices[0].logprobs.content or []]
    thought = next(k for k in range(len(tokens) + 1) if "</think>" in "".join(tokens[:k]))
    assert response.usage is not None and response.usage.completion_tokens_details is not None
    assert response.usage.completion_tokens_details.reasoning_tokens == thought
    assert 0 < thought < response.usage.completion_tokens
    raw = {k: v for k, v in request.items() if k != "extra_body"}
    raw.update(request["extra_body"], stream=True, stream_options={"include_usage": True})
    with (  # the raw events: reasoning_content deltas
        reasoning_server.client() as c,
        c.stream("POST", "/v1/chat/completions", json=raw) as r,
    ):
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content", "") for d in deltas) == whole.content
    assert sum("reasoning_content" in d for d in deltas) > 1  # streamed, not held to the end
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    # Sent back in the conversation under either name, it is the same prompt.
    with reasoning_server.client() as c:
        usages = []
        for field in ("reasoning_content", "reasoning"):
            said = {"role": "assistant", "content": whole.content, field: reasoning}
            messages = [*QUESTION, said, {"role": "user", "content": "And?"}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 1}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"]["prompt_tokens"])
    assert usages[0] == usages[1]


def test_answers_without_thinking_are_content(reasoning_server: RunningServer) -> None:
    with httpx.Client(base_url=reasoning_server.url, timeout=60) as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": QUESTION,
                "max_tokens": 20,
                "structured_outputs": {"choice": ["plain answer"]},
            },
        )
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "plain answer"
    assert "reasoning_content" not in message and "reasoning" not in message
    assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_a_schema_applies_after_the_think_block(reasoning_server: RunningServer) -> None:
    """With a reasoning parser, response_format constrains the answer, after an optional
    <think> block: the model may reason first (the grammar of the pair is tested in
    tests/engine/test_structured_outputs.py), and whatever answer it gives validates."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    thought: list[bool] = []
    for seed in range(6):
        choice = (
            sdk(reasoning_server)
            .chat.completions.create(
                model=MODEL,
                messages=QUESTION,
                max_tokens=60,
                seed=seed,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "city", "schema": schema},
                },
            )
            .choices[0]
        )
        content = choice.message.content
        thought.append(bool(getattr(choice.message, "reasoning_content", None)))
        if choice.finish_reason == "stop":  # the answer was given: it validates
            jsonschema.validate(json.loads(content or ""), schema)
    # Without the think block a JSON answer must begin with "{": no request could reason.
    assert any(thought), thought
