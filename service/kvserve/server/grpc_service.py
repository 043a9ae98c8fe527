"""The engine's gRPC API (``engine.proto``) over an ``AsyncEngine``, on grpc.aio.

The servicer runs on the same asyncio event loop as the ``AsyncEngine`` (start both from
one loop). A ``Generate`` call streams a ``Delta`` for every engine step that added
tokens or text, then one ``Final``. When the client cancels the call or its deadline
expires, grpc.aio cancels the handler; closing the engine stream then aborts the request
in the engine, which frees its KV blocks before the next step.

``GenerateMany`` carries many requests over one call, each named by the client's tag,
and writes one message per batch of ready outputs instead of one per request and step:
per-message cost is what limits a gateway, not bytes. Ending that call aborts whatever
it started that is still running.

Requests are converted to and from messages by ``kvserve.rpc.codec`` only. A refused
request's error names its parameter in a structured field (``Error.param``, and in a
failed ``Generate`` call's trailing metadata).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import NoReturn

import grpc

from kvserve.engine.async_engine import (
    MERGE_AFTER,
    AdapterUnavailableError,
    AsyncEngine,
    EngineDeadError,
    GrammarFailedError,
    RequestFailedError,
)
from kvserve.engine.request import Request
from kvserve.errors import InvalidRequestError
from kvserve.lora.request import ADAPTER_UNAVAILABLE
from kvserve.openai.chat_output import ChatOutputParser, ChatParsing, JoinedPieces
from kvserve.openai.errors import OpenAIError
from kvserve.openai.format import Echo, decoded, tokenizer_text
from kvserve.outputs import RequestOutput
from kvserve.rpc import codec
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from kvserve.rpc.listen import MIN_PING_INTERVAL_MS, bind, server_options
from kvserve.sampling_params import StopLimits
from kvserve.server.chat import prepare_chat, validate_constraint
from kvserve.server.lora import LoRAAdapters
from kvserve.telemetry.tracing import RequestTelemetry

log = logging.getLogger(__name__)

# A GenerateMany batch is split above this many outputs (a client that fell far behind
# must not get one message over its receive limit).
MAX_OUTPUTS_PER_MESSAGE = 1024
# ... and after its first large output (an echo: a prompt's text and scores, at most
# MAX_PROMPT_LOGPROB_ENTRIES of them; or a request's steps merged while the client was
# behind), at most this many bytes of large ones: a gateway receives messages of up to
# kvserve.rpc.listen.MAX_MESSAGE_BYTES.
MAX_LARGE_BYTES_PER_MESSAGE = 4 * 1024 * 1024


class _Refused(Exception):
    """A request the engine will not (or can no longer) serve, as a gRPC status."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        param: str | None = None,
        openai_code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.openai_code = openai_code

    @property
    def error(self) -> pb.Error:
        return codec.encode_error(self.code, self.message, self.param, self.openai_code)


def _refusal(exc: BaseException, grammar_param: str | None = None) -> _Refused:
    """The status a failure while building or running a request ends its call with;
    ``grammar_param``: the field the request's constraint came in."""
    if isinstance(exc, _Refused):
        return exc
    if isinstance(exc, EngineDeadError):
        return _Refused(grpc.StatusCode.UNAVAILABLE, str(exc))
    if isinstance(exc, InvalidRequestError):
        return _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.param, exc.code)
    if isinstance(exc, ValueError):
        return _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, GrammarFailedError):  # the request's own constraint
        return _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc), grammar_param)
    if isinstance(exc, AdapterUnavailableError):  # a gateway tries another replica
        return _Refused(grpc.StatusCode.UNAVAILABLE, str(exc), openai_code=ADAPTER_UNAVAILABLE)
    if isinstance(exc, RequestFailedError):
        return _Refused(grpc.StatusCode.INTERNAL, str(exc))
    return _Refused(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


class EngineServicer(pb_grpc.EngineServiceServicer):
    """``kvserve.engine.v1.EngineService`` over one ``AsyncEngine`` (same event loop)."""

    def __init__(
        self,
        engine: AsyncEngine,
        telemetry: RequestTelemetry | None = None,
        stop_limits: StopLimits | None = None,
        chat_parsing: ChatParsing | None = None,
        lora: LoRAAdapters | None = None,
        admitting: Callable[[], bool] = lambda: True,
        preparing: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self.engine = engine
        # Counts a request while it is built (ServerState.prepared): a drain waits for it.
        self.preparing = preparing
        # False while the server drains (SIGTERM): new requests are refused UNAVAILABLE,
        # which the gateway retries on another replica, as HTTP answers them 503.
        self.admitting = admitting
        self.telemetry = telemetry
        self.stop_limits = stop_limits or StopLimits()
        self.chat_parsing = chat_parsing or ChatParsing()
        # The adapters served by name (shared with the HTTP API; none: LoRA off).
        self.lora = lora or LoRAAdapters("", enabled=False)

    async def build_request(
        self, request: pb.GenerateRequest, metadata: Callable[[], Mapping[str, str]]
    ) -> tuple[Request, _Started]:
        """``_build``, counted as preparing (the caller submits the result before its next
        await, so a drain always sees it in one count or the other)."""
        with self.preparing():
            return await self._build(request, metadata)

    async def _build(
        self, request: pb.GenerateRequest, metadata: Callable[[], Mapping[str, str]]
    ) -> tuple[Request, _Started]:
        """The engine request for ``request`` and what its outputs need to become messages
        (the reader of a chat's answer, when the server reads tool calls or reasoning; the
        field its constraint came in); raises ``_Refused`` for bad input.

        ``request.request_id`` is the client's id (the engine mints its own key; empty
        means none). ``metadata`` gives the call's (or the command's) trace context, read
        only when tracing is on. A long prompt is tokenized off the event loop.
        """
        arrival = time.monotonic()
        if not self.admitting():
            raise _Refused(grpc.StatusCode.UNAVAILABLE, "draining: not admitting new requests")
        engine = self.engine.engine
        adapter = codec.decode_lora_adapter(request)
        try:
            lora = self.lora.adapter(adapter, "lora_adapter") if adapter is not None else None
        except OpenAIError as exc:
            raise _lora_refusal(exc) from None
        try:
            prompt = codec.decode_prompt(request)
            request_id = codec.decode_request_id(request)
            cap = codec.decode_max_tokens_cap(request)
            constraint = codec.decode_constraint(request)
            structured = constraint.params if constraint is not None else None
            grammar_param = constraint.param if constraint is not None else None
            new_parser: Callable[[bool], ChatOutputParser | None] | None = None
            default_max_tokens = None
            chat_prompt = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
            echo: str | None = None  # the prompt's text, when the request echoes it
            if request.echo and chat_prompt:
                raise InvalidRequestError("echo needs a prompt of text or token ids", "echo")
            if request.echo:
                echo = prompt if isinstance(prompt, str) else decoded(engine.tokenizer, prompt)  # type: ignore[arg-type]
            if chat_prompt:
                chat = await prepare_chat(
                    self.engine,
                    self.chat_parsing,
                    prompt,  # type: ignore[arg-type]
                    codec.decode_chat_tools(request),
                    constraint,
                    codec.decode_template_kwargs(request),
                    codec.decode_chat_ending(request),
                )
                prompt, structured, new_parser = chat.prompt_ids, chat.constraint, chat.new_parser
                grammar_param = chat.constraint_param
                # A chat without max_tokens gets as much as the context allows, or the
                # gateway's cap if that is less.
                default_max_tokens = engine.context_left(len(prompt))
                if cap is not None:
                    default_max_tokens = min(default_max_tokens, cap)
            elif request.tools or request.HasField("tool_choice"):
                raise InvalidRequestError("tools and tool_choice need a chat prompt", "tools")
            elif request.chat_ending:
                raise InvalidRequestError("chat_ending needs a chat prompt", "chat_ending")
            elif constraint is not None:
                await validate_constraint(self.engine, constraint)
            params = codec.decode_sampling_params(
                request, default_max_tokens=default_max_tokens, constraint=structured
            )
            self.stop_limits.check(params.stop)
            parser = None if new_parser is None else new_parser(params.skip_special_tokens)
            req = self.engine.make_request(
                await self.engine.prepare(prompt),  # type: ignore[arg-type]
                params,
                request_id,
                arrival_time=arrival,
                cache_salt=codec.decode_cache_salt(request),
                lora_request=lora,
            )
        except (EngineDeadError, ValueError) as exc:  # InvalidRequestError is a ValueError
            raise _refusal(exc) from None
        if self.telemetry is not None:  # continues the gateway's W3C traceparent
            operation = "chat" if request.WhichOneof("prompt") == "chat" else "text_completion"
            self.telemetry.begin(
                req.request_id, operation, params, metadata(), arrival, req.external_id, adapter
            )
        started = _Started(
            req.request_id,
            parser=parser,
            whole_calls=_whole_calls(request),
            grammar_param=grammar_param,
            echo=echo,
        )
        return req, started

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # A coroutine handler writing with context.write (not an async generator): a
        # cancellation (client gone, deadline) then always lands inside this coroutine,
        # where ``_closing`` closes the engine stream at once, which aborts the request.
        try:
            req, started = await self.build_request(request, lambda: _call_metadata(context))
        except _Refused as exc:
            await _abort(context, exc)

        token_text = tokenizer_text(self.engine.engine.tokenizer)
        last: RequestOutput | None = None
        final: pb.Final | None = None
        try:
            async with _closing(self.engine.stream(req)) as outputs:
                async for out in outputs:
                    last = out
                    delta, final = started.encode(out, token_text)
                    if delta is not None:
                        await context.write(pb.GenerateResponse(delta=delta))
        except (EngineDeadError, RequestFailedError, ValueError) as exc:
            await _abort(context, _refusal(exc, started.grammar_param))
        if last is None or not last.finished or final is None:
            await _abort(
                context, _Refused(grpc.StatusCode.INTERNAL, "the engine stream ended early")
            )
        await context.write(pb.GenerateResponse(final=final))

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[pb.GenerateManyRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        call = _ManyCall(self, context)
        try:
            await call.run(request_iterator)
        finally:  # the call ended (or was cancelled): nothing of it runs on
            call.abort_all()

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        if request.request_id:  # every request with this client id (ids need not be unique)
            self.engine.abort_external(request.request_id)
        return pb.AbortResponse()

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        if self.engine.dead is not None:
            return pb.HealthResponse(serving=False, message=f"engine stopped: {self.engine.dead}")
        if not self.admitting():
            return pb.HealthResponse(serving=False, message="draining: not admitting requests")
        return pb.HealthResponse(serving=True, message="ok")

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadResponse:
        stats = self.engine.engine.stats()
        num_blocks = stats.num_kv_blocks
        return pb.GetLoadResponse(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            kv_cache_usage=stats.kv_cache_usage,
            block_size=self.engine.engine.config.block_size,
            num_blocks=num_blocks,
            num_free_blocks=round((1.0 - stats.kv_cache_usage) * num_blocks),
            max_model_len=self.engine.engine.max_model_len,
            lora_adapters=list(self.lora.served()),
            max_loras=self.engine.engine.config.max_loras if self.lora.enabled else 0,
            # The gateway keeps polling a draining replica (its streams are still open):
            # without this flag, each answer would make it look ready for new requests.
            draining=not self.admitting(),
        )

    async def LoadLoRAAdapter(
        self, request: pb.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadLoRAAdapterResponse:
        try:
            lora = await self.lora.load(
                self.engine, request.lora_name, request.lora_path, inplace=request.load_inplace
            )
        except (OpenAIError, EngineDeadError) as exc:
            await _abort(context, _lora_refusal(exc))
        return pb.LoadLoRAAdapterResponse(
            adapter=pb.LoRAAdapter(name=lora.lora_name, path=lora.lora_path)
        )

    async def UnloadLoRAAdapter(
        self, request: pb.UnloadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoRAAdapterResponse:
        try:
            await self.lora.unload(self.engine, request.lora_name)
        except (OpenAIError, EngineDeadError) as exc:
            await _abort(context, _lora_refusal(exc))
        return pb.UnloadLoRAAdapterResponse()

    async def ListLoRAAdapters(
        self, request: pb.ListLoRAAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLoRAAdaptersResponse:
        slots = self.engine.engine.config.max_loras if self.lora.enabled else 0
        return pb.ListLoRAAdaptersResponse(
            adapters=[
                pb.LoRAAdapter(name=lora.lora_name, path=lora.lora_path)
                for lora in self.lora.served().values()
            ],
            max_loras=slots,
        )


_LORA_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    503: grpc.StatusCode.UNAVAILABLE,
}


def _lora_refusal(exc: BaseException) -> _Refused:
    """A refused adapter name, load or unload (an HTTP-shaped error) as a gRPC status."""
    if isinstance(exc, OpenAIError):
        code = _LORA_CODES.get(exc.status, grpc.StatusCode.INTERNAL)
        return _Refused(code, exc.message, exc.param, exc.code)
    return _refusal(exc)


@dataclass
class _Started:
    """A started request: what its outputs need to become messages."""

    request_id: str
    num_sent: int = 0  # output tokens already sent (to pick each delta's logprobs)
    parser: ChatOutputParser | None = None  # reads a chat's reasoning and tool calls
    # Without the request's tool_call_pieces: each call leaves whole (older gateways).
    whole_calls: JoinedPieces | None = None
    grammar_param: str | None = None  # the field the request's constraint came in
    echo: str | None = None  # the prompt's text, until the first delta has echoed it
    sent_prompt_tokens: bool = False  # the first delta carried the prompt's length

    def encode(
        self, out: RequestOutput, token_text: Callable[[int], str]
    ) -> tuple[pb.Delta | None, pb.Final | None]:
        """The output's ``Delta`` (None if it added nothing) and, on the last, ``Final``."""
        completion = out.outputs[0]
        parsed, finish_reason = None, None
        if self.parser is not None:
            parsed, finish_reason = self.parser.step(
                completion.delta_text,
                completion.finish_reason if out.finished else None,
                completion.delta_token_ids,
                completion.stop_reason,
            )
            if self.whole_calls is not None:
                parsed = self.whole_calls.join(parsed, out.finished)
        delta = codec.encode_delta(completion, self.num_sent, token_text, parsed)
        if delta is not None:
            self.num_sent += len(delta.token_ids)
        # The echo goes with the first delta, or alone when the request ends with none
        # (max_tokens 0: the prompt scored, nothing generated), unless it was aborted.
        if self.echo is not None and (delta is not None or completion.finish_reason == "length"):
            delta = delta or pb.Delta()
            delta.echo.CopyFrom(codec.encode_echo(Echo.of(self.echo, out), token_text))
            self.echo = None
        if delta is not None and not self.sent_prompt_tokens:
            delta.prompt_tokens = len(out.prompt_token_ids)
            self.sent_prompt_tokens = True
        final = None
        if out.finished:
            reasoning = self.parser.reasoning_tokens(completion.token_ids) if self.parser else None
            final = codec.encode_final(out, finish_reason, reasoning)
        return delta, final


def _whole_calls(request: pb.GenerateRequest) -> JoinedPieces | None:
    return None if request.tool_call_pieces else JoinedPieces()


class _ManyCall:
    """One ``GenerateMany`` call: the requests it started, and the batches it writes.

    Engine outputs arrive through ``AsyncEngine.add_request`` sinks, one event-loop
    callback per engine step, and wait per tag until the writer turns what waits into
    messages and sends them together in one. Invariant (the engine's ``RequestStream``'s):
    at most ``MERGE_AFTER`` outputs of a request wait; one that arrives when that many do
    absorbs the latest (``RequestOutput.absorb``), so a client that stops reading holds a
    bounded number of outputs per request, the last growing with its text, while one that
    reads gets every step's delta as it was.

    Each start is built in a task of its own: a request whose building takes long (a
    long prompt tokenized off the loop, a grammar compiled) must not hold up the starts
    and cancels behind it on the call, which through the gateway carries every tenant's
    requests to this replica. A cancel for a request still being built ends it there.
    """

    def __init__(self, servicer: EngineServicer, context: grpc.aio.ServicerContext) -> None:
        self.servicer = servicer
        self.engine = servicer.engine
        self.context = context
        self.token_text = tokenizer_text(servicer.engine.engine.tokenizer)
        self.started: dict[int, _Started] = {}
        self.starting: dict[int, asyncio.Task[None]] = {}  # being built
        # Per tag, in order of first arrival: its outputs not yet encoded.
        self.pending: dict[int, _Waiting] = {}
        self.ready: list[pb.TaggedOutput] = []  # encoded, to write
        self.sizes: list[int] = []  # per ready output: its size if it may be large, else 0
        self.wake = asyncio.Event()

    async def run(self, commands: AsyncIterator[pb.GenerateManyRequest]) -> None:
        reader = asyncio.ensure_future(self._read(commands))
        reader.add_done_callback(lambda _: self.wake.set())
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                while self.ready or self.pending:
                    await self.context.write(pb.GenerateManyResponse(outputs=self._batch()))
                ended = not self.started and not self.starting
                if reader.done() and (ended or reader.exception() is not None):
                    break  # the client half-closed and everything it started has ended
        finally:
            reader.cancel()
        if (exc := reader.exception()) is not None:
            raise exc

    async def _read(self, commands: AsyncIterator[pb.GenerateManyRequest]) -> None:
        async for message in commands:
            for command in message.commands:
                kind = command.WhichOneof("kind")
                if kind == "start":
                    self._encode(command.tag)  # (its last output may be waiting)
                    if self._in_use(command.tag):
                        self._end_reused_tag(command.tag)
                        continue
                    task = asyncio.create_task(self._start(command))
                    self.starting[command.tag] = task
                    task.add_done_callback(functools.partial(self._built, command.tag))
                elif kind == "cancel":
                    started = self.started.get(command.tag)
                    if started is not None:  # ends with a Final (finish_reason "abort")
                        await self.engine.abort(started.request_id)
                    elif (building := self.starting.get(command.tag)) is not None and (
                        # A start that already ended (refused: its Error is its last
                        # output) is not cancelled, and gets no second ending.
                        building.cancel()  # never reaches the engine
                    ):
                        final = pb.Final(finish_reason="abort", usage=pb.Usage())
                        self._push(pb.TaggedOutput(tag=command.tag, final=final))

    async def _start(self, command: pb.TaggedCommand) -> None:
        tag = command.tag
        try:
            req, started = await self.servicer.build_request(
                command.start, lambda: dict(command.metadata)
            )
            self.engine.add_request(req, functools.partial(self._on_output, tag, started))
        except Exception as exc:  # fails this request only; the call serves the others
            if not isinstance(exc, _Refused | EngineDeadError):
                log.exception("request with tag %d failed to start", tag)
            self._push(_error_output(tag, _refusal(exc)))
            return
        self.started[tag] = started

    def _built(self, tag: int, task: asyncio.Task[None]) -> None:
        if self.starting.get(tag) is task:  # (a new start may have taken the tag since)
            del self.starting[tag]
        self.wake.set()  # the call may be over now

    def _in_use(self, tag: int) -> bool:
        """The tag names a request that has not sent its last output (a start that was
        refused while being built has sent its Error: the tag is free again)."""
        building = self.starting.get(tag)
        return tag in self.started or (building is not None and not building.done())

    def _end_reused_tag(self, tag: int) -> None:
        """A start with the tag of an open request: the client can no longer tell their
        outputs apart, so the open request ends too (aborted: nothing more of it is sent)
        and the tag gets one ending, this Error; the new start is not run."""
        refused = _Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tag {tag} was started again while its request was open: "
            "that request is aborted and the new one not started",
        )
        if (started := self.started.get(tag)) is not None:
            self._end(tag, started, abort=True)
        else:
            self.starting[tag].cancel()  # still being built: it never reaches the engine
        self._push(_error_output(tag, refused))

    def _on_output(self, tag: int, started: _Started, out: RequestOutput | BaseException) -> None:
        if self.started.get(tag) is not started:
            return  # ended already (its tag started again): nothing more of it is sent
        if isinstance(out, BaseException):  # the engine failed it
            self._encode(tag)  # what it gave before goes first
            self._push(_error_output(tag, _refusal(out, started.grammar_param)))
            self._end(tag, started, abort=True)
            return
        waiting = self.pending.setdefault(tag, _Waiting(started))
        if len(waiting.outputs) >= MERGE_AFTER:
            waiting.outputs[-1] = out.absorb(waiting.outputs[-1])
            waiting.merged = True
        else:
            waiting.outputs.append(out)
        self.wake.set()

    def _encode(self, tag: int) -> None:
        """The tag's waiting outputs, as messages ready to write."""
        waiting = self.pending.pop(tag, None)
        if waiting is None:
            return
        started, last = waiting.started, len(waiting.outputs) - 1
        for i, out in enumerate(waiting.outputs):
            try:
                delta, final = started.encode(out, self.token_text)
            except Exception as exc:  # turning it into messages failed
                log.exception("request %s failed in GenerateMany", started.request_id)
                self._push(_error_output(tag, _refusal(exc, started.grammar_param)))
                self._end(tag, started, abort=True)
                return
            if delta is not None:  # the last may have absorbed many: measured
                self._push(pb.TaggedOutput(tag=tag, delta=delta), waiting.merged and i == last)
            if final is not None:
                self._push(pb.TaggedOutput(tag=tag, final=final))
                self._end(tag, started, abort=False)

    def _batch(self) -> list[pb.TaggedOutput]:
        """The next message's outputs: the ready ones (the waiting ones encoded when none
        are), at most MAX_OUTPUTS_PER_MESSAGE, and after the first no more large ones
        (echoes, merged outputs) than MAX_LARGE_BYTES_PER_MESSAGE."""
        if not self.ready:
            for tag in list(self.pending):
                self._encode(tag)
        n, size = 0, 0
        while n < min(len(self.ready), MAX_OUTPUTS_PER_MESSAGE):
            size += self.sizes[n]
            if n and size > MAX_LARGE_BYTES_PER_MESSAGE:
                break
            n += 1
        batch = self.ready[:n]
        del self.ready[:n], self.sizes[:n]
        return batch

    def _push(self, output: pb.TaggedOutput, measure: bool = False) -> None:
        """Queue ``output``; ``measure``: it may be large (an echo is measured anyway)."""
        self.ready.append(output)
        echoes = output.WhichOneof("kind") == "delta" and output.delta.HasField("echo")
        self.sizes.append(output.ByteSize() if echoes or measure else 0)
        self.wake.set()

    def _end(self, tag: int, started: _Started, abort: bool) -> None:
        if self.started.get(tag) is started:
            del self.started[tag]
        self.engine.release(started.request_id, abort=abort)

    def abort_all(self) -> None:
        self.pending.clear()
        for task in list(self.starting.values()):
            task.cancel()
        for tag, started in list(self.started.items()):
            self._end(tag, started, abort=True)


@dataclass
class _Waiting:
    """A GenerateMany request's outputs not yet encoded; ``merged``: the last absorbed
    later ones (then it may be large)."""

    started: _Started
    outputs: list[RequestOutput] = field(default_factory=list)
    merged: bool = False


def _error_output(tag: int, refused: _Refused) -> pb.TaggedOutput:
    return pb.TaggedOutput(tag=tag, error=refused.error)


def _call_metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


async def _abort(context: grpc.aio.ServicerContext, refused: _Refused) -> NoReturn:
    """End the call with ``refused``'s status; its ``Error`` rides in the trailers."""
    await context.abort(
        refused.code, refused.message, trailing_metadata=codec.error_metadata(refused.error)
    )
    raise AssertionError("context.abort returned")  # it always raises


@asynccontextmanager
async def _closing(
    stream: AsyncIterator[RequestOutput],
) -> AsyncIterator[AsyncIterator[RequestOutput]]:
    """Close the engine stream as soon as the block exits (cancelled or not).

    Closing it runs ``AsyncEngine.stream``'s cleanup, which aborts an unfinished request.
    """
    try:
        yield stream
    finally:
        if isinstance(stream, AsyncGenerator):
            await stream.aclose()


def add_engine_service(
    server: grpc.aio.Server,
    engine: AsyncEngine,
    telemetry: RequestTelemetry | None = None,
    stop_limits: StopLimits | None = None,
    chat_parsing: ChatParsing | None = None,
    lora: LoRAAdapters | None = None,
    admitting: Callable[[], bool] = lambda: True,
    preparing: Callable[[], AbstractContextManager[None]] = nullcontext,
) -> None:
    """Register the engine service on a grpc.aio server (running on the engine's loop)."""
    servicer = EngineServicer(
        engine, telemetry, stop_limits, chat_parsing, lora, admitting, preparing
    )
    pb_grpc.add_EngineServiceServicer_to_server(servicer, server)


async def start_grpc_server(
    engine: AsyncEngine,
    host: str,
    port: int,
    telemetry: RequestTelemetry | None = None,
    *,
    min_ping_interval_ms: int = MIN_PING_INTERVAL_MS,
    stop_limits: StopLimits | None = None,
    chat_parsing: ChatParsing | None = None,
    lora: LoRAAdapters | None = None,
    admitting: Callable[[], bool] = lambda: True,
    preparing: Callable[[], AbstractContextManager[None]] = nullcontext,
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server with the engine service; ``port=0`` picks a free port.

    Returns the server and the bound port. Stop it with ``await server.stop(grace)``.
    """
    server = grpc.aio.server(options=server_options(min_ping_interval_ms))
    add_engine_service(
        server, engine, telemetry, stop_limits, chat_parsing, lora, admitting, preparing
    )
    bound = bind(server, host, port)
    await server.start()
    log.info("gRPC engine service listening on %s:%d", host, bound)
    return server, bound
