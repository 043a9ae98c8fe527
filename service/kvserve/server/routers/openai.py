"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` (OpenAI semantics)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvserve.engine.async_engine import (
    AdapterUnavailableError,
    AsyncEngine,
    EngineDeadError,
    GrammarFailedError,
    RequestFailedError,
)
from kvserve.engine.request import Request as EngineRequest
from kvserve.errors import InvalidRequestError
from kvserve.lora.request import ADAPTER_UNAVAILABLE, LoRARequest
from kvserve.openai import checks
from kvserve.openai import format as fmt
from kvserve.openai.body import body_schema, parse_body
from kvserve.openai.chat_output import ChatDelta, ChatOutputParser, delta_chunks
from kvserve.openai.disconnect import until_disconnected
from kvserve.openai.errors import OpenAIError, error_body
from kvserve.openai.messages import template_messages
from kvserve.openai.protocol import ChatCompletionRequest, CommonRequest, CompletionRequest
from kvserve.openai.sse import SSE_DONE, EventStreamResponse, TextEvents, encode_event
from kvserve.openai.structured import requested_constraint
from kvserve.openai.tools import chat_tools
from kvserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server.chat import prepare_chat, validate_constraint
from kvserve.server.state import ServerState, State, server_state

router = APIRouter()
Answer = JSONResponse | EventStreamResponse
Route = Callable[[Request], Awaitable[Answer]]


def _admitted(handler: Route) -> Route:
    """A completion route: refused with a 503 while the server drains, as soon as the
    request's head is in (its body unread); else counted in ``ServerState.preparing``
    until the handler returns (a streamed answer is in the engine by then, a whole one
    finished), so that a drain waits for a request still on its way to the engine: its
    body arriving, its prompts being tokenized."""

    @functools.wraps(handler)
    async def admitted(request: Request) -> Answer:
        state = server_state(request)
        if not state.admitting:
            raise OpenAIError(503, "the server is shutting down; retry on another replica")
        with state.prepared():
            return await handler(request)

    return admitted


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    """The base model, then each LoRA adapter (``parent``: the base model)."""
    return {"object": "list", "data": state.lora.models(state.created, state.max_model_len)}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, state: State) -> dict[str, Any]:
    """One entry of ``/v1/models`` (OpenAI's retrieve), or 404 ``model_not_found``."""
    return fmt.model_entry(model, state.lora.models(state.created, state.max_model_len))


@router.post("/v1/completions", response_model=None, openapi_extra=body_schema(CompletionRequest))
@_admitted
async def completions(request: Request) -> JSONResponse | EventStreamResponse:
    arrival = time.monotonic()
    body = await parse_body(request, CompletionRequest)
    state = server_state(request)
    lora = _check_common(body, state)
    prompts = checks.completion_prompts(body)
    limit = checks.token_limit(body).value
    assert limit is not None  # a completion's limit defaults to 16
    constraint = requested_constraint(body)
    param = constraint.param if constraint is not None else None
    if constraint is not None:
        try:
            await validate_constraint(state.engine, constraint)
        except InvalidRequestError as exc:
            raise OpenAIError.invalid_request(exc) from exc
    reqs = await _make_requests(
        state,
        request,
        body,
        prompts,
        limit,
        arrival,
        constraint.params if constraint else None,
        lora,
        param,
    )
    ids = fmt.response_ids(request.state.request_id, body.model, False, int(time.time()))
    text_of = fmt.tokenizer_text(state.tokenizer)

    # ``echo``: each prompt's text (a token-id prompt's decoded once for all its samples).
    echo_texts = [
        p if isinstance(p, str) else fmt.decoded(state.tokenizer, p)
        for p in (prompts if body.echo else [])
    ]

    def echo_of(out: RequestOutput) -> fmt.Echo:
        """The prompt of ``out``'s choice, and its scores if logprobs are on."""
        return fmt.Echo.of(echo_texts[out.outputs[0].index // body.n], out)

    if body.stream:  # each sample's state by its index (its output's ``index``)
        plain = [TextEvents(ids, chat=False, index=i) for i in range(len(reqs))]
        streamed = [fmt.StreamedCompletionLogprobs() for _ in reqs]
        echoed = [not body.echo] * len(reqs)  # the prompt has gone out (or was not asked for)

        def chunk(out: RequestOutput) -> bytes:
            c = out.outputs[0]
            logprobs = _delta_logprobs(c)
            if logprobs is None and c.finish_reason is None and echoed[c.index]:
                return plain[c.index].text(c.delta_text)
            text, lp = c.delta_text, None
            if not echoed[c.index]:  # the choice's first chunk starts with the prompt
                echoed[c.index] = True
                echo = echo_of(out)
                text = echo.text + text
                if logprobs is not None:
                    lp = echo.logprobs(logprobs, text_of, streamed[c.index])
            elif logprobs is not None:
                lp = streamed[c.index].chunk(logprobs, text_of)
            event = fmt.completion_chunk(ids, text, lp, c.finish_reason, c.index)
            return encode_event(fmt.finished(event, c.stop_reason))

        return _sse(state, reqs, chunk, ids, False, body.include_usage, body.n, grammar_param=param)

    outs = await _run_to_end(request, state.engine, reqs, grammar_param=param)
    choices = []
    for out in outs:
        c = out.outputs[0]
        text = c.text
        logprobs = fmt.completion_logprobs(c.logprobs, text_of) if c.logprobs else None
        if body.echo:
            echo = echo_of(out)
            text = echo.text + text
            logprobs = echo.logprobs(c.logprobs, text_of) if c.logprobs is not None else None
        choice = fmt.completion_choice(c.index, text, logprobs, c.finish_reason)
        choices.append(fmt.with_stop_reason(choice, c.stop_reason))
    return JSONResponse(fmt.completion_response(ids, choices, _usage(outs, body.n)))


@router.post(
    "/v1/chat/completions", response_model=None, openapi_extra=body_schema(ChatCompletionRequest)
)
@_admitted
async def chat_completions(request: Request) -> JSONResponse | EventStreamResponse:
    arrival = time.monotonic()
    body = await parse_body(request, ChatCompletionRequest)
    state = server_state(request)
    lora = _check_common(body, state)
    limit = checks.token_limit(body).value
    messages = template_messages(body.messages)
    tools = chat_tools(body)
    constraint = requested_constraint(body)
    try:
        chat = await prepare_chat(
            state.engine,
            state.chat_parsing,
            messages,
            tools,
            constraint,
            body.template_kwargs(),
            body.chat_ending(),
        )
    except InvalidRequestError as exc:
        raise OpenAIError.invalid_request(exc, f"model {state.served_model_name!r}: ") from exc
    if limit is None:  # as much as the context allows
        limit = state.engine.engine.context_left(len(chat.prompt_ids))
    reqs = await _make_requests(
        state,
        request,
        body,
        [chat.prompt_ids],
        limit,
        arrival,
        chat.constraint,
        lora,
        chat.constraint_param,
    )
    ids = fmt.response_ids(request.state.request_id, body.model, True, int(time.time()))
    text_of = fmt.tokenizer_text(state.tokenizer)
    # Each sample's state by its index (its output's ``index``): its answer's reader.
    parsers = [chat.new_parser(body.skip_special_tokens) for _ in reqs]

    if body.stream:
        # A sample's first delta carries the role; with several, all open up front.
        first = [len(reqs) == 1] * len(reqs)
        openings = fmt.chat_openings(ids, len(reqs)) if len(reqs) > 1 else []
        plain = [TextEvents(ids, chat=True, index=i) for i in range(len(reqs))]

        def chunk(out: RequestOutput) -> bytes:
            c = out.outputs[0]
            i, parser = c.index, parsers[c.index]
            entries = _delta_logprobs(c)
            logprobs = fmt.chat_logprobs(entries, text_of) if entries is not None else None
            if parser is not None:  # reasoning and tool calls read out of the text
                delta, finish = parser.step(
                    c.delta_text, c.finish_reason, c.delta_token_ids, c.stop_reason
                )
                events = delta_chunks(ids, delta, logprobs, finish, first[i], i)
                first[i] = first[i] and not events
                return b"".join(encode_event(fmt.finished(e, c.stop_reason)) for e in events)
            if not first[i] and logprobs is None and c.finish_reason is None:
                return plain[i].text(c.delta_text)
            event = fmt.chat_chunk(ids, c.delta_text, logprobs, c.finish_reason, first[i], index=i)
            first[i] = False
            return encode_event(fmt.finished(event, c.stop_reason))

        markers = parsers[0] is not None and bool(parsers[0].markers)
        return _sse(
            state, reqs, chunk, ids, True, body.include_usage, body.n, markers,
            chat.constraint_param, b"".join(map(encode_event, openings)),
            _reasoning_counter(parsers),
        )  # fmt: skip

    if parsers[0] is None:
        outs = await _run_to_end(request, state.engine, reqs, grammar_param=chat.constraint_param)
        choices = []
        for out in outs:
            c = out.outputs[0]
            logprobs = fmt.chat_logprobs(c.logprobs, text_of) if c.logprobs else None
            choice = fmt.chat_choice(c.index, c.text, logprobs, c.finish_reason)
            choices.append(fmt.with_stop_reason(choice, c.stop_reason))
        return JSONResponse(fmt.chat_response(ids, choices, _usage(outs, body.n)))
    # Read step by step, as a stream is: a marker token is put back where it was.
    answers = [ChatDelta() for _ in reqs]
    finishes: list[str | None] = [None] * len(reqs)

    def read(out: RequestOutput) -> None:
        c = out.outputs[0]
        parser = parsers[c.index]
        assert parser is not None
        delta, finishes[c.index] = parser.step(
            c.delta_text, c.finish_reason, c.delta_token_ids, c.stop_reason
        )
        answers[c.index] = answers[c.index].extend(delta)

    outs = await _run_to_end(request, state.engine, reqs, read, chat.constraint_param)
    choices = []
    for out in outs:
        c = out.outputs[0]
        answer = answers[c.index]
        choice = fmt.chat_choice(
            c.index,
            answer.content,
            fmt.chat_logprobs(c.logprobs, text_of) if c.logprobs else None,
            finishes[c.index],
            reasoning=answer.reasoning or None,
            tool_calls=answer.tool_calls,
        )
        choices.append(fmt.with_stop_reason(choice, c.stop_reason))
    usage = _usage(outs, body.n, _reasoning_counter(parsers))
    return JSONResponse(fmt.chat_response(ids, choices, usage))


# ---- shared pieces -------------------------------------------------------------------
def _check_common(body: CommonRequest, state: ServerState) -> LoRARequest | None:
    """Checks both endpoints share; the LoRA adapter ``model`` names (None: the base)."""
    lora = state.lora.resolve(body.model)  # 404 model_not_found for an unknown name
    checks.check_options(body)
    checks.check_stop(body, state.stop_limits)
    return lora


async def _make_requests(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[str | list[int]],
    max_tokens: int,
    arrival: float,
    constraint: StructuredOutputsParams | None,
    lora: LoRARequest | None = None,
    grammar_param: str | None = None,
) -> list[EngineRequest]:
    """The engine requests, one per prompt and sample (``n``), prompt i's sample j at
    index i·n + j (each is its own engine request, named by the engine; ``x-request-id``
    is kept as the client's on every one), their grammars compiled (``grammar_param``:
    the field the constraint came in)."""
    rid: str = request.state.request_id
    try:
        params = body.sampling_params(max_tokens, checks.logprobs_count(body), constraint)
        samples = params.samples()
        reqs = []
        for p, prompt in enumerate(prompts):
            prepared = await state.engine.prepare(prompt)
            for j, sample in enumerate(samples):
                req = state.engine.make_request(
                    prepared,
                    sample,
                    rid,
                    arrival_time=arrival,
                    cache_salt=body.cache_salt,
                    lora_request=lora,
                    sample_index=p * len(samples) + j,
                )
                reqs.append(req)
                prepared = req.prompt_token_ids  # tokenized once for all its samples
        await _compiled(reqs, grammar_param)
        operation = "chat" if isinstance(body, ChatCompletionRequest) else "text_completion"
        parent = None  # the first sample's: the caller's traceparent, in the headers
        for req in reqs:
            parent = state.telemetry.begin(
                req.request_id,
                operation,
                req.params,
                request.headers,
                arrival,
                rid,
                lora.lora_name if lora is not None else None,
                parent,
            )
        return reqs
    except EngineDeadError as exc:
        raise OpenAIError(503, str(exc)) from exc
    except InvalidRequestError as exc:
        raise checks.in_client_terms(OpenAIError.invalid_request(exc), body) from exc


async def _compiled(reqs: Sequence[EngineRequest], grammar_param: str | None) -> None:
    """Wait for the requests' grammars to compile (the engine waits for them anyway): one
    that cannot be enforced (it compiles, yet matches no text) is the request's 400 now,
    before a stream's 200, not an error event after it."""
    for req in reqs:
        if req.grammar is not None:
            try:
                await asyncio.wrap_future(req.grammar.compiled)
            except InvalidRequestError as exc:
                raise OpenAIError(400, f"structured outputs: {exc}", param=grammar_param) from None
            except Exception:  # the engine fails the request alone at admission, as before
                pass


def _delta_logprobs(c: CompletionOutput) -> Sequence[TokenLogprob] | None:
    """This step's logprob entries (the last ones of the cumulative list)."""
    if c.logprobs is None:
        return None
    return c.logprobs[len(c.logprobs) - len(c.delta_token_ids) :]


# Of a choice's last output: how many of its tokens are reasoning (None: not counted).
ReasoningCounter = Callable[[RequestOutput], int | None]


def _reasoning_counter(parsers: Sequence[ChatOutputParser | None]) -> ReasoningCounter:
    """A chat's ``ReasoningCounter``: its choice's reader counts (by the output's index)."""

    def count(out: RequestOutput) -> int | None:
        parser = parsers[out.outputs[0].index]
        return parser.reasoning_tokens(out.outputs[0].token_ids) if parser is not None else None

    return count


def _usage(
    outs: Sequence[RequestOutput], n: int, reasoning: ReasoningCounter | None = None
) -> dict[str, Any]:
    """A response's usage, from its choices' last outputs (``n`` per prompt): each prompt
    once (and its first sample's cached share of it), every choice's output, and where
    ``reasoning`` counts them, every choice's reasoning tokens."""
    firsts = [out for out in outs if out.outputs[0].index % n == 0]
    prompt_tokens = sum(len(out.prompt_token_ids) for out in firsts)
    output_tokens = sum(len(out.outputs[0].token_ids) for out in outs)
    counts = [reasoning(out) for out in outs] if reasoning is not None else []
    counted = [c for c in counts if c is not None]
    reasoning_tokens = sum(counted) if counted and len(counted) == len(counts) else None
    cached = sum(out.num_cached_tokens for out in firsts)
    return fmt.usage(prompt_tokens, output_tokens, cached, reasoning_tokens)


def _sse(
    state: ServerState,
    reqs: list[EngineRequest],
    chunk: Callable[[RequestOutput], bytes],
    ids: dict[str, Any],
    chat: bool,
    include_usage: bool,
    n: int,
    every_token: bool = False,
    grammar_param: str | None = None,
    opening: bytes = b"",
    reasoning: ReasoningCounter | None = None,
) -> EventStreamResponse:
    """``every_token``: ``chunk`` also sees outputs that added no text (a marker token
    that the text leaves out, which the parser puts back). ``grammar_param``: the field
    the request's constraint came in (see ``_failure``). ``opening``: events that go
    first (the choices' openings). ``reasoning``: counts the usage's reasoning tokens."""
    # The requests enter the engine now, before the response starts; the response's
    # close (end, client gone, or never started) aborts those that have not finished.
    try:
        outputs = state.engine.submit(*reqs)
    except EngineDeadError as exc:
        raise OpenAIError(503, str(exc)) from exc

    async def events() -> AsyncIterator[bytes]:
        last: RequestOutput | None = None
        lasts: dict[int, RequestOutput] = {}  # each sample's latest output
        parts: list[bytes] = [opening] if opening else []
        try:
            async for out in outputs:
                # Outputs that arrived while the previous write was going out leave together;
                # the last ones wait to leave with the usage and [DONE] in one write.
                for last in (out, *outputs.ready()):
                    c = last.outputs[0]
                    lasts[c.index] = last
                    if (
                        c.delta_text
                        or c.finish_reason is not None
                        or c.logprobs is not None
                        or (every_token and c.delta_token_ids)
                    ):
                        event = chunk(last)
                        if event:  # empty while a parser holds text back
                            parts.append(event)
                if parts and not outputs.finished:
                    yield b"".join(parts)
                    parts = []
        except (RequestFailedError, EngineDeadError) as exc:
            error = _failure(exc, reqs[0], grammar_param)
            body = error_body(
                error.status, error.message, error.param, request_id=reqs[0].external_id
            )
            parts.append(encode_event(body))
        if include_usage and lasts:
            usage = _usage([lasts[i] for i in sorted(lasts)], n, reasoning)
            parts.append(encode_event(fmt.usage_chunk(ids, chat, usage)))
        yield b"".join([*parts, SSE_DONE])

    return EventStreamResponse(
        events(), on_close=outputs.close, write_timeout=state.write_stall_timeout
    )


async def _run_to_end(
    request: Request,
    engine: AsyncEngine,
    reqs: list[EngineRequest],
    each: Callable[[RequestOutput], None] | None = None,
    grammar_param: str | None = None,
) -> list[RequestOutput]:
    """Run a non-streaming request's samples, aborting them if the client disconnects
    meanwhile; ``each`` sees every output. Returns each sample's last output, in index
    order. ``grammar_param``: see ``_failure``."""

    async def last_outputs() -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async for out in engine.stream(*reqs):
            if each is not None:
                each(out)
            last[out.outputs[0].index] = out
        return [last[i] for i in range(len(reqs))]

    try:
        outs = await until_disconnected(request, last_outputs())
    except (EngineDeadError, RequestFailedError) as exc:
        raise _failure(exc, reqs[0], grammar_param) from exc
    if outs is None:
        raise OpenAIError(499, "client disconnected")
    return outs


def _failure(
    exc: RequestFailedError | EngineDeadError, req: EngineRequest, grammar_param: str | None
) -> OpenAIError:
    """The error a request that failed in the engine ends with: 400 naming the constraint
    (``grammar_param``, the field the client sent it in) when its own grammar failed it,
    503 when the engine is gone or the adapter's files can no longer be read, else 500."""
    why = f"request {req.external_id} failed: {exc}"
    if isinstance(exc, GrammarFailedError):
        return OpenAIError(400, why, param=grammar_param)
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc))
    if isinstance(exc, AdapterUnavailableError):
        return OpenAIError(503, str(exc), code=ADAPTER_UNAVAILABLE)
    return OpenAIError(500, why)
