"""The one mapping between the engine's objects and ``engine.proto``, both directions.

The gateway encodes requests and decodes outputs; the engine server decodes requests and
encodes outputs. Each field is converted in one place here, so a parameter added to the
API is added to this module and nowhere else on the wire path.

Errors are structured: an ``Error`` message names the parameter it is about (``param``),
and a failed call carries that message, serialized, in its trailing metadata under
``ERROR_METADATA_KEY``. No message string is ever parsed for it.

This module loads neither torch nor the engine: the gateway imports it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from kvserve.conversation import ChatEnding
from kvserve.errors import InvalidRequestError
from kvserve.json_input import JSONInputError, parse_json_object
from kvserve.openai.chat_output import ChatDelta
from kvserve.openai.format import Echo, TokenText, ToolCallDelta
from kvserve.openai.messages import tool_call_arguments
from kvserve.openai.middleware import MAX_REQUEST_ID_LEN, valid_request_id
from kvserve.openai.protocol import CHAT_ROLES, FUNCTION_NAME_PATTERN, MAX_CACHE_SALT_CHARS
from kvserve.openai.structured import Constraint
from kvserve.openai.tools import (
    EMPTY_PARAMETERS,
    ChatTools,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from kvserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvserve.rpc import engine_pb2 as pb
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.telemetry import definitions as d

# Where a failed call's ``Error`` travels (a "-bin" key: gRPC carries its value as bytes).
ERROR_METADATA_KEY = "kvserve-error-bin"

# A prompt as the API carries it: text, token ids, or a conversation (its messages as
# chat templates take them: kvserve/openai/messages.py).
Prompt = str | list[int] | list[dict[str, Any]]

_FUNCTION_NAME = re.compile(FUNCTION_NAME_PATTERN)

# Optional request fields: set on the wire only when the client set them, so an unset one
# keeps the engine's default (``SamplingParams``).
_OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
)


# ---- requests ------------------------------------------------------------------------

# ChatEnding on the wire (GenerateRequest.chat_ending).
_CHAT_ENDINGS: dict[ChatEnding, pb.ChatEnding] = {
    "generation_prompt": pb.CHAT_ENDING_GENERATION_PROMPT,
    "none": pb.CHAT_ENDING_NONE,
    "continue_final_message": pb.CHAT_ENDING_CONTINUE_FINAL_MESSAGE,
}
_ENDING_OF = {value: ending for ending, value in _CHAT_ENDINGS.items()}


def encode_request(
    prompt: Prompt,
    params: SamplingParams,
    *,
    request_id: str = "",
    max_tokens_set: bool = True,
    max_tokens_cap: int | None = None,
    cache_salt: str | None = None,
    tools: ChatTools | None = None,
    constraint: Constraint | None = None,
    template_kwargs: dict[str, Any] | None = None,
    chat_ending: ChatEnding = "generation_prompt",
    echo: bool = False,
) -> pb.GenerateRequest:
    """``GenerateRequest`` for ``prompt`` (text, token ids, or chat messages).

    ``echo``: the replica sends the prompt back in the first delta (OpenAI's ``echo``).

    ``request_id`` is the client's id (not a key; the engine mints its own).
    ``max_tokens_set=False`` leaves ``max_tokens`` unset, so the engine gives a chat as many
    tokens as its context leaves (the OpenAI default when the client sets no limit), or
    ``max_tokens_cap`` if that is fewer.
    """
    req = pb.GenerateRequest(
        request_id=request_id,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
    )
    if max_tokens_set:
        req.max_tokens = params.max_tokens
    if params.seed is not None:
        req.seed = params.seed
    if params.repetition_penalty != 1:
        req.repetition_penalty = params.repetition_penalty
    if params.logit_bias:
        req.logit_bias.update(params.logit_bias)
    if params.min_tokens:
        req.min_tokens = params.min_tokens
    if params.logprobs is not None:
        req.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        req.prompt_logprobs = params.prompt_logprobs
    req.echo = echo
    if cache_salt is not None:
        req.cache_salt = cache_salt
    if max_tokens_cap is not None and not max_tokens_set:
        req.max_tokens_cap = max_tokens_cap
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif prompt and isinstance(prompt[0], dict):
        messages = [_message_to_proto(m) for m in prompt]  # type: ignore[arg-type]
        req.chat.CopyFrom(pb.ChatMessages(messages=messages))
    else:
        req.prompt_token_ids.CopyFrom(pb.TokenIds(ids=prompt))  # type: ignore[arg-type]
    if tools is not None and tools.tools:
        req.tools.extend(
            pb.Tool(
                name=t.name,
                description=t.description,
                parameters_json=json.dumps(t.parameters),
                strict=t.strict,
            )
            for t in tools.tools
        )
        req.tool_choice.CopyFrom(
            pb.ToolChoice(mode=tools.choice.mode, function=tools.choice.function or "")
        )
        req.parallel_tool_calls = tools.parallel
        req.tool_call_pieces = True  # this gateway joins pieces (older replicas send none)
    if constraint is not None:
        req.structured_outputs.CopyFrom(_constraint_to_proto(constraint))
    if template_kwargs:
        req.chat_template_kwargs_json = json.dumps(template_kwargs)
    req.chat_ending = _CHAT_ENDINGS[chat_ending]
    return req


def _message_to_proto(m: dict[str, Any]) -> pb.ChatMessage:
    msg = pb.ChatMessage(role=m["role"])
    for name in ("content", "tool_call_id", "name", "reasoning_content"):
        if m.get(name) is not None:
            setattr(msg, name, m[name])
    msg.tool_calls.extend(
        pb.ToolCall(
            id=c["id"],
            name=c["function"]["name"],
            arguments=_arguments_text(c["function"]["arguments"]),
        )
        for c in m.get("tool_calls") or ()
    )
    return msg


def _message_from_proto(i: int, m: pb.ChatMessage) -> dict[str, Any]:
    if m.role not in CHAT_ROLES:
        param = f"chat.messages[{i}].role"
        raise InvalidRequestError(f"{param} must be one of {', '.join(CHAT_ROLES)}", param)
    out: dict[str, Any] = {"role": m.role, "content": m.content if m.HasField("content") else ""}
    for name in ("tool_call_id", "name", "reasoning_content"):
        if m.HasField(name):
            out[name] = getattr(m, name)
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": tool_call_arguments(c.arguments)},
            }
            for c in m.tool_calls
        ]
    return out


def _arguments_text(arguments: dict[str, Any] | str) -> str:
    """A call's arguments on the wire: the object as JSON, or text that is not one as it is
    (``openai.messages.tool_call_arguments`` reads both back)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _constraint_to_proto(constraint: Constraint) -> pb.StructuredOutputs:
    p = constraint.params
    so = pb.StructuredOutputs(param=constraint.param)
    if p.json is not None:
        so.json_schema = p.json if isinstance(p.json, str) else json.dumps(p.json)
    elif p.json_object:
        so.json_object = True
    elif p.regex is not None:
        so.regex = p.regex
    elif p.choice is not None:
        so.choice.CopyFrom(pb.Choices(values=p.choice))
    elif p.grammar is not None:
        so.grammar = p.grammar
    return so


def decode_constraint(request: pb.GenerateRequest) -> Constraint | None:
    """The output constraint, or None; InvalidRequestError naming the client's field."""
    if not request.HasField("structured_outputs"):
        return None
    so = request.structured_outputs
    param = so.param or "structured_outputs"
    kind = so.WhichOneof("kind")
    try:
        if kind == "json_schema":
            params = StructuredOutputsParams(json=so.json_schema)
        elif kind == "json_object":
            params = StructuredOutputsParams(json_object=True)
        elif kind == "regex":
            params = StructuredOutputsParams(regex=so.regex)
        elif kind == "choice":
            params = StructuredOutputsParams(choice=list(so.choice.values))
        elif kind == "grammar":
            params = StructuredOutputsParams(grammar=so.grammar)
        else:
            raise InvalidRequestError("structured_outputs sets no constraint", param)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param) from None
    return Constraint(params, param)


def decode_chat_tools(request: pb.GenerateRequest) -> ChatTools:
    """The chat's tools and tool choice (the gateway checked names and choice; checked
    again here, for any other client)."""
    tools = []
    for i, t in enumerate(request.tools):
        if _FUNCTION_NAME.fullmatch(t.name) is None:
            param = f"tools[{i}].function.name"
            raise InvalidRequestError(f"{param} must be 1-64 letters, digits, _ or -", param)
        # Unset (proto3's empty string) or {}: no parameters, as over HTTP.
        param = f"tools[{i}].function.parameters"
        parameters = _json_object(t.parameters_json, param) if t.parameters_json else {}
        description = t.description if t.HasField("description") else None
        tools.append(ToolSpec(t.name, description, parameters or EMPTY_PARAMETERS, t.strict))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool names must be unique", "tools")
    mode = request.tool_choice.mode if request.HasField("tool_choice") else ""
    if not mode:
        choice = ToolChoice("auto" if tools else "none")
    elif mode in ("none", "auto", "required", "function"):
        choice = ToolChoice(cast(ToolChoiceMode, mode), request.tool_choice.function or None)
    else:
        raise InvalidRequestError(f"unknown tool_choice {mode!r}", "tool_choice")
    if choice.mode == "function" and choice.function not in names:
        raise InvalidRequestError(
            f"tool_choice names the function {choice.function!r}, which is not among the tools",
            "tool_choice",
        )
    if choice.mode == "required" and not tools:
        raise InvalidRequestError('tool_choice "required" needs tools', "tool_choice")
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return ChatTools(tuple(tools), choice, parallel)


def decode_chat_ending(request: pb.GenerateRequest) -> ChatEnding:
    """How the chat's prompt ends; InvalidRequestError for a value this replica lacks."""
    ending = _ENDING_OF.get(request.chat_ending)
    if ending is None:
        raise InvalidRequestError(f"unknown chat_ending {request.chat_ending}", "chat_ending")
    return ending


def decode_template_kwargs(request: pb.GenerateRequest) -> dict[str, Any] | None:
    """The chat's extra chat-template variables, or None."""
    if not request.chat_template_kwargs_json:
        return None
    return _json_object(request.chat_template_kwargs_json, "chat_template_kwargs")


def _json_object(text: str, param: str) -> dict[str, Any]:
    """``text`` read as a JSON object; InvalidRequestError naming ``param`` otherwise."""
    try:
        return parse_json_object(text)
    except JSONInputError as e:
        raise InvalidRequestError(f"{param}: {e}", param) from None


def decode_prompt(request: pb.GenerateRequest) -> Prompt:
    """The prompt: text, token ids, or the chat's messages (the engine renders those).

    Raises InvalidRequestError (naming the field) when there is none.
    """
    kind = request.WhichOneof("prompt")
    if kind == "prompt_text":
        return request.prompt_text
    if kind == "prompt_token_ids":
        return list(request.prompt_token_ids.ids)
    if kind == "chat":
        messages = [_message_from_proto(i, m) for i, m in enumerate(request.chat.messages)]
        if not messages:
            raise InvalidRequestError("chat.messages must not be empty", "chat")
        return messages
    raise InvalidRequestError("set prompt_text, prompt_token_ids or chat", "prompt")


def decode_sampling_params(
    request: pb.GenerateRequest,
    *,
    default_max_tokens: int | None = None,
    constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams from a request; unset optional fields keep the engine's defaults
    (``default_max_tokens``, when given, stands in for an unset ``max_tokens``).
    ``constraint``: the output constraint (``decode_constraint``, or a tool-call grammar).

    Raises InvalidRequestError (naming the field) for values the engine rejects.
    """
    kwargs: dict[str, Any] = {
        name: getattr(request, name) for name in _OPTIONAL_SAMPLING_FIELDS if request.HasField(name)
    }
    if default_max_tokens is not None:
        kwargs.setdefault("max_tokens", default_max_tokens)
    if request.logit_bias:
        kwargs["logit_bias"] = dict(request.logit_bias)
    return SamplingParams(
        stop=list(request.stop),
        stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        structured_outputs=constraint,
        **kwargs,
    )


def decode_request_id(request: pb.GenerateRequest) -> str | None:
    """The client's id (None: unset), held to ``x-request-id``'s rule: it is logged."""
    rid = request.request_id
    if rid and not valid_request_id(rid):
        raise InvalidRequestError(
            f"request_id must be 1-{MAX_REQUEST_ID_LEN} printable ASCII characters", "request_id"
        )
    return rid or None


def decode_cache_salt(request: pb.GenerateRequest) -> str | None:
    if not request.HasField("cache_salt"):
        return None
    if not 0 < len(request.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            f"cache_salt must be 1-{MAX_CACHE_SALT_CHARS} characters", "cache_salt"
        )
    return request.cache_salt


def decode_lora_adapter(request: pb.GenerateRequest) -> str | None:
    """The LoRA adapter's name (None: the base model)."""
    return request.lora_adapter if request.HasField("lora_adapter") else None


def decode_max_tokens_cap(request: pb.GenerateRequest) -> int | None:
    if not request.HasField("max_tokens_cap"):
        return None
    if request.max_tokens_cap < 1:
        raise InvalidRequestError(
            f"max_tokens_cap must be ≥ 1, got {request.max_tokens_cap}", "max_tokens_cap"
        )
    return request.max_tokens_cap


# ---- outputs -------------------------------------------------------------------------
def _logprobs_to_proto(
    entries: Sequence[TokenLogprob], token_text: TokenText
) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            top=e.top,
            token=token_text(e.token_id),
            top_tokens={t: token_text(t) for t in e.top},
        )
        for e in entries
    ]


def encode_echo(echo: Echo, token_text: TokenText) -> pb.Echo:
    message = pb.Echo(text=echo.text, logprobs=_logprobs_to_proto(echo.entries, token_text))
    if echo.unscored:
        message.first_token_id = echo.unscored[0]
        message.first_token = token_text(echo.unscored[0])
    return message


def decode_echo(delta: pb.Delta) -> tuple[Echo, DeltaLogprobs] | None:
    """The prompt a first ``Delta`` echoes (None if it has none), and its tokens' texts."""
    if not delta.HasField("echo"):
        return None
    echo = delta.echo
    scores = _decode_logprobs(echo.logprobs)
    if not echo.HasField("first_token_id"):
        return Echo(echo.text), scores
    scores.texts[echo.first_token_id] = echo.first_token
    return Echo(echo.text, [echo.first_token_id], scores.entries), scores


def encode_delta(
    completion: CompletionOutput,
    num_sent: int,
    token_text: TokenText = str,
    parsed: ChatDelta | None = None,
) -> pb.Delta | None:
    """What this step added, or None if it added nothing.

    ``num_sent``: tokens already streamed (to pick this step's logprob entries).
    ``parsed``: the step as the chat's parsers read it (its text is then the content).
    """
    if not completion.delta_token_ids and not completion.delta_text and not parsed:
        return None
    if parsed is None:
        delta = pb.Delta(token_ids=completion.delta_token_ids, text=completion.delta_text)
    else:
        delta = pb.Delta(
            token_ids=completion.delta_token_ids,
            text=parsed.content,
            reasoning=parsed.reasoning,
            tool_calls=[
                pb.ToolCallDelta(
                    index=c.index,
                    call=pb.ToolCall(id=c.id or "", name=c.name or "", arguments=c.arguments),
                )
                for c in parsed.tool_calls
            ],
        )
    if completion.logprobs is not None:
        end = num_sent + len(completion.delta_token_ids)
        delta.logprobs.extend(_logprobs_to_proto(completion.logprobs[num_sent:end], token_text))
    return delta


def encode_final(
    out: RequestOutput, finish_reason: str | None = None, reasoning_tokens: int | None = None
) -> pb.Final:
    """The closing message: finish reason, usage, server-side timings.

    ``finish_reason`` overrides the engine's (a chat parser's "tool_calls");
    ``reasoning_tokens``: a reasoning parser's count, if there is one.
    ``s`` is the request's arrival at the engine; every figure comes from
    ``kvserve.telemetry.definitions``; an undefined figure is 0.
    """
    completion = out.outputs[0]
    m = out.metrics
    s = m.arrival_time
    final = pb.Final(
        finish_reason=finish_reason or completion.finish_reason or "abort",
        usage=pb.Usage(
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(completion.token_ids),
            cached_tokens=out.num_cached_tokens,
            reasoning_tokens=reasoning_tokens,
        ),
        num_preemptions=m.num_preemptions,
    )
    if isinstance(completion.stop_reason, str):
        final.stop_reason = completion.stop_reason
    elif isinstance(completion.stop_reason, int):
        final.stop_token_id = completion.stop_reason
    if m.first_scheduled_time is not None:
        final.queue_time = d.queue_time(s, m.first_scheduled_time)
    if m.first_token_time is not None and m.token_times:
        f, e = m.first_token_time, m.token_times[-1]
        final.ttft = d.ttft(s, f)
        final.e2e = d.e2e(s, e)
        final.tpot = d.tpot(f, e, len(m.token_times)) or 0.0
    return final


def decode_stop_reason(final: pb.Final) -> str | int | None:
    """What ended a sample, from its ``Final``: the stop string, the stop token id, or
    None (EOS, the length, ...)."""
    if final.HasField("stop_reason"):
        return str(final.stop_reason)
    if final.HasField("stop_token_id"):
        return int(final.stop_token_id)
    return None


@dataclass
class DeltaLogprobs:
    """A delta's logprob entries and the texts of their tokens (the gateway has no tokenizer)."""

    entries: list[TokenLogprob]
    texts: dict[int, str]

    def token_text(self, token_id: int) -> str:
        return self.texts.get(token_id, str(token_id))


def decode_delta_logprobs(delta: pb.Delta) -> DeltaLogprobs | None:
    """The logprobs carried by a ``Delta`` (None when the request asked for none)."""
    if not delta.logprobs:
        return None
    return _decode_logprobs(delta.logprobs)


def _decode_logprobs(logprobs: Iterable[pb.TokenLogprob]) -> DeltaLogprobs:
    entries: list[TokenLogprob] = []
    texts: dict[int, str] = {}
    for lp in logprobs:
        # A protobuf map has no order: most likely first, as the engine lists them.
        top = dict(sorted(lp.top.items(), key=lambda item: -item[1]))
        entries.append(TokenLogprob(lp.token_id, lp.logprob, top))
        texts[lp.token_id] = lp.token
        texts.update(lp.top_tokens)
    return DeltaLogprobs(entries, texts)


def decode_chat_delta(delta: pb.Delta) -> ChatDelta:
    """A delta's content, reasoning and tool-call pieces (an id opens a call)."""
    return ChatDelta(
        delta.text,
        delta.reasoning,
        [
            ToolCallDelta(c.index, c.call.arguments, c.call.id or None, c.call.name or None)
            for c in delta.tool_calls
        ],
    )


# ---- errors --------------------------------------------------------------------------
def encode_error(
    code: grpc.StatusCode, message: str, param: str | None = None, openai_code: str | None = None
) -> pb.Error:
    error = pb.Error(code=code.value[0], message=message)
    if param is not None:
        error.param = param
    if openai_code is not None:
        error.openai_code = openai_code
    return error


def error_metadata(error: pb.Error) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata that carries ``error`` with a failed call's status."""
    return ((ERROR_METADATA_KEY, error.SerializeToString()),)


def status_code(error: pb.Error) -> grpc.StatusCode:
    return _STATUS_BY_VALUE.get(error.code, grpc.StatusCode.UNKNOWN)


def error_fields(
    trailing_metadata: Iterable[tuple[str, str | bytes]] | None,
) -> tuple[str | None, str | None]:
    """The parameter a failed call's ``Error`` names and OpenAI's error code it carries
    (None each when unset, or when the replica sent no ``Error``: an older one, or a
    failure outside the engine)."""
    for key, value in trailing_metadata or ():
        if key == ERROR_METADATA_KEY and isinstance(value, bytes):
            try:
                error = pb.Error.FromString(value)
            except DecodeError:
                break
            param = error.param if error.HasField("param") else None
            return param, error.openai_code if error.HasField("openai_code") else None
    return None, None


_STATUS_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}
