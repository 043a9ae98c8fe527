"""The asyncio face of the engine.

The engine's step loop runs in one dedicated thread, so the HTTP and gRPC servers'
event loop never waits for a forward pass. The event loop talks to that thread through
a command queue (add, abort); the thread hands each step's outputs back with one
``call_soon_threadsafe`` per step. An abort is applied before the next step starts, so a
cancelled request stops costing compute within one step.

The engine names each request itself (``make_request`` mints ``Request.request_id``); the
client's id is kept as ``Request.external_id``. Clients choose their ids, so two of them
may send the same one at the same time, or reuse an id while the engine is still
aborting the request that had it: neither may fail nor receive the other's outputs.

If the engine thread dies (an uncaught error, or with tensor parallelism a worker rank
lost), every stream ends with ``EngineDeadError``, ``dead`` is set (the health probes
answer 503) and ``EngineHooks.on_dead`` is called: the server then exits non-zero.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvserve.conversation import ChatEnding, text_chars
from kvserve.engine.llm_engine import EngineStats, LLMEngine
from kvserve.engine.request import Request
from kvserve.errors import InvalidRequestError
from kvserve.lora.adapter import AdapterUnreadableError
from kvserve.lora.request import LoRARequest
from kvserve.outputs import RequestOutput
from kvserve.parallel.group import GroupFailedError
from kvserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Tokenizing a prompt of more characters than this leaves the event loop: ~1 ms of work on
# the loop is the most a request may cost the other streams and the health probes.
OFFLOAD_CHARS = 16_384
# Outputs a request's stream keeps apart for a consumer that fell behind (they leave as
# one SSE event each, as the engine stepped); beyond this, each new output absorbs the
# last one, so a client that stops reading holds O(its length) memory, not a copy of
# the output so far per step.
MERGE_AFTER = 64
TOKENIZER_THREADS = 2
# With tensor parallelism, how often an idle engine checks that its workers live.
KEEPALIVE_SECONDS = 2.0
_T = TypeVar("_T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; other requests carry on."""


class GrammarFailedError(RequestFailedError):
    """The request's own grammar ended it while it ran: the grammar engine refused a
    token, or the grammar grew past its limits (``a{1000000}`` passes its compile and
    fails on the first ``a``). The client's constraint, not the server: front ends answer
    it as bad input, naming the field the constraint came in."""


class AdapterUnavailableError(RequestFailedError):
    """The request's LoRA adapter can no longer be read from the server's disk (its
    folder was removed, or its files changed since it was loaded). Neither the client's
    fault nor a bug: front ends answer it as unavailable (HTTP 503, gRPC UNAVAILABLE), so
    that a gateway tries a replica whose copy is intact, and stop listing the adapter
    until it is loaded again. The message names the adapter, never its path."""

    def __init__(self, lora: LoRARequest, message: str) -> None:
        super().__init__(message)
        self.lora = lora


def _enqueue_failure(exc: Exception) -> Exception:
    """What a request that could not be queued fails with: the client's mistake as it
    is (``InvalidRequestError``: a 400), an adapter that cannot be read back from disk as
    ``AdapterUnavailableError``, anything else as this request's failure inside the
    engine."""
    if isinstance(exc, InvalidRequestError):
        return exc
    if isinstance(exc, AdapterUnreadableError):
        return AdapterUnavailableError(exc.lora, str(exc))
    return RequestFailedError(f"the engine could not queue the request: {exc}")


@dataclass
class _Add:
    request: Request


@dataclass
class _Abort:
    request_id: str


class _Wake:
    """A grammar a request waits for is compiled: step again."""


@dataclass
class _Lost:
    """A tensor-parallel worker died: the engine cannot step any more."""

    why: str


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread (LoRA adapters change there); its result
    or exception settles ``future`` on the event loop."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


# Receives a request's outputs on the event loop (see ``AsyncEngine.add_request``).
OutputSink = Callable[[RequestOutput | BaseException], None]


@dataclass
class EngineHooks:
    """Called from the engine thread (keep them quick and thread-safe)."""

    on_finished: Callable[[RequestOutput], None] | None = None
    on_failed: Callable[[Request], None] | None = None
    on_stats: Callable[[EngineStats], None] | None = None
    on_dead: Callable[[BaseException], None] | None = None


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        hooks: EngineHooks | None = None,
    ) -> None:
        self.engine = engine
        self.hooks = hooks or EngineHooks()
        self._commands: queue.SimpleQueue[_Add | _Abort | _Wake | _Lost | _Call | None] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, OutputSink] = {}  # engine id → consumer
        self._external_ids: dict[str, str | None] = {}  # engine id → client id, in flight
        self._next_id = itertools.count()
        self._tokenizers: ThreadPoolExecutor | None = None  # for long prompts, made on first use
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None
        engine.on_grammar_ready = lambda: self._commands.put(_Wake())
        engine.on_worker_lost = lambda why: self._commands.put(_Lost(why))

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever is left and stop the engine thread."""
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self._tokenizers is not None:
            self._tokenizers.shutdown(wait=False, cancel_futures=True)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests ----------------------------------------------------------------------
    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        external_id: str | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        sample_index: int = 0,
    ) -> Request:
        """Tokenize and validate; raises ValueError for bad input (before any streaming).

        The request gets an engine id of its own; ``external_id`` (the client's, any
        string, unique or not) travels with it into outputs, logs and spans.
        ``sample_index``: which of its prompt's samples it is (``SamplingParams.samples``).
        """
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        return self.engine.build_request(
            f"req-{next(self._next_id)}",
            prompt,
            params,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            external_id=external_id,
            lora_request=lora_request,
            sample_index=sample_index,
        )

    async def prepare(self, prompt: str | list[int]) -> str | list[int]:
        """The prompt as ``make_request`` takes it: a long text tokenized off the event loop
        (so other streams and health probes are not stalled meanwhile), anything else as
        it is (``make_request`` tokenizes a short text itself)."""
        if isinstance(prompt, str) and len(prompt) > OFFLOAD_CHARS:
            return await self._off_loop(self.engine.tokenize, prompt)
        return prompt

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        ending: ChatEnding = "generation_prompt",
    ) -> list[int]:
        """``LLMEngine.chat_prompt``, off the event loop for a long conversation."""
        if text_chars(messages, tools) <= OFFLOAD_CHARS:
            return self.engine.chat_prompt(messages, tools, template_kwargs, ending)
        return await self._off_loop(
            lambda m: self.engine.chat_prompt(m, tools, template_kwargs, ending), messages
        )

    async def _off_loop(self, fn: Callable[[_T], list[int]], arg: _T) -> list[int]:
        if self._tokenizers is None:
            self._tokenizers = ThreadPoolExecutor(
                TOKENIZER_THREADS, thread_name_prefix="kvserve-tokenize"
            )
        return await asyncio.get_running_loop().run_in_executor(self._tokenizers, fn, arg)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        external_id: str | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``async for out in engine.generate(...)``: ``make_request`` then ``stream``."""
        req = self.make_request(
            prompt, params, external_id, arrival_time=arrival_time, cache_salt=cache_salt
        )
        async for out in self.stream(req):
            yield out

    def submit(self, *reqs: Request) -> RequestStream:
        """Hand ``reqs`` (one, or the samples of one prompt) to the engine thread now;
        iterate the result for their outputs, interleaved.

        The caller must ``close()`` the stream (it aborts the requests that have not
        finished), so a request whose response never starts does not run on.
        """
        if not reqs:
            raise ValueError("submit needs at least one request")
        stream = RequestStream(self, [req.request_id for req in reqs])
        try:
            for req in reqs:
                self.add_request(req, stream.put)
        except BaseException:
            stream.close()
            raise
        return stream

    def add_request(self, req: Request, on_output: OutputSink) -> None:
        """Hand ``req`` to the engine thread now; ``on_output`` gets, on the event loop,
        each of its outputs in order (the last one finished) or the exception that ends it.

        All the outputs of one engine step are handed over in one event-loop callback, so a
        consumer of many requests can batch them. The caller must ``release`` the request.
        """
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        if req.request_id in self._streams:  # a Request object submitted twice
            raise ValueError(f"request {req.request_id} was already submitted")
        self._streams[req.request_id] = on_output
        self._external_ids[req.request_id] = req.external_id
        self._commands.put(_Add(req))

    async def stream(self, *reqs: Request) -> AsyncIterator[RequestOutput]:
        """Yield an output every step a request makes progress, until each one's last
        (finished) output; ``reqs`` as for ``submit``.

        If the consumer stops early (client gone, task cancelled), the requests are
        aborted in the engine before their next step.
        """
        outputs = self.submit(*reqs)
        try:
            async for out in outputs:
                yield out
        finally:
            outputs.close()

    async def abort(self, request_id: str) -> None:
        """Abort the request with this engine id (its stream ends with "abort")."""
        self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        """Abort every in-flight request (their streams end with "abort")."""
        for rid in list(self._streams):
            self._commands.put(_Abort(rid))

    def abort_external(self, external_id: str) -> int:
        """Abort every in-flight request whose client id is ``external_id``; how many."""
        found = [rid for rid, ext in self._external_ids.items() if ext == external_id]
        for rid in found:
            self._commands.put(_Abort(rid))
        return len(found)

    async def call(self, fn: Callable[[LLMEngine], _T]) -> _T:
        """``fn(engine)``'s result, run on the engine thread between two steps (what
        changes the engine's state, such as loading a LoRA adapter, must run there)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        future: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, future))
        return await future

    def release(self, request_id: str, abort: bool) -> None:
        """The consumer is done with a request's outputs; ``abort`` it if still running.

        The engine id is never reused, so outputs the engine thread still sends for this
        request (the abort is applied before its next step) reach no one.
        """
        if abort:
            self._commands.put(_Abort(request_id))
        self._streams.pop(request_id, None)
        self._external_ids.pop(request_id, None)

    # ---- the engine thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # Block only when there is nothing to step (requests that wait for their
                # grammar are not: its compile wakes the thread with a _Wake).
                idle = not self.engine.has_work()
                first = self._next_command() if idle else None
                commands = [first] if first is not None or idle else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if None in commands and self._stopping:
                    self._abort_all()
                    return
                self._apply(c for c in commands if c is not None)
                if self.engine.has_work():
                    self._step()
        except BaseException as exc:
            log.exception("engine thread died")
            self.dead = exc
            self._deliver_all(EngineDeadError(f"the engine stopped: {exc}"))
            if self.hooks.on_dead is not None:
                self.hooks.on_dead(exc)

    def _next_command(self) -> _Add | _Abort | _Wake | _Lost | _Call | None:
        """Wait for a command. With tensor parallelism an idle engine sends the workers
        a keepalive every ``KEEPALIVE_SECONDS``: a worker lost on another node surfaces
        as a ``GroupFailedError`` here, not at the next request."""
        if self.engine.group is None:
            return self._commands.get()
        while True:
            try:
                return self._commands.get(timeout=KEEPALIVE_SECONDS)
            except queue.Empty:
                self.engine.keepalive()

    def _apply(self, commands: object) -> None:
        aborted: list[RequestOutput] = []
        for cmd in commands:  # type: ignore[attr-defined]
            if isinstance(cmd, _Add):
                rid = cmd.request.request_id
                try:
                    self.engine.enqueue(cmd.request)
                except Exception as exc:  # fails this request, never the engine thread
                    if self.hooks.on_failed is not None:
                        self.hooks.on_failed(cmd.request)
                    self._deliver(rid, _enqueue_failure(exc))
                    continue
                if rid not in self._streams:  # the client left before the engine saw it
                    aborted += self.engine.abort_request(rid)
            elif isinstance(cmd, _Abort):
                aborted += self.engine.abort_request(cmd.request_id)
            elif isinstance(cmd, _Call):
                self._settle(cmd)
            elif isinstance(cmd, _Lost):
                raise GroupFailedError(cmd.why)
        if aborted:
            self._publish(aborted)

    def _settle(self, cmd: _Call) -> None:
        try:
            result, error = cmd.fn(self.engine), None
        except Exception as exc:
            result, error = None, exc
        if self._loop is None:
            return

        def settle() -> None:  # on the event loop
            if cmd.future.done():  # the caller was cancelled
                return
            if error is not None:
                cmd.future.set_exception(error)
            else:
                cmd.future.set_result(result)

        self._loop.call_soon_threadsafe(settle)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except GroupFailedError:
            raise  # a rank is gone: no later step can run either
        except Exception as exc:
            if self.engine.group is not None:
                # Rank 0 may have failed between two of the step's collectives, which
                # the other ranks then wait for: the ranks are out of step, and the next
                # step would hang until the collective timeout. Fatal, as a lost rank is.
                raise GroupFailedError(f"a step failed on rank 0: {exc}") from exc
            # A failure inside a batched step cannot be pinned on one request: fail the
            # requests of that batch, keep the engine serving the others.
            log.exception("engine step failed; failing the requests in that batch")
            sched = self.engine.last_schedule
            batch = [req for req, _ in sched.scheduled] if sched is not None else []
            self.engine.abort_request([r.request_id for r in batch])
            for req in batch:
                if self.hooks.on_failed is not None:
                    self.hooks.on_failed(req)
                self._deliver(req.request_id, RequestFailedError(f"engine error: {exc}"))
            self._report_stats()
            return
        failures = self.engine.take_failures()
        if failures:  # requests that failed alone (a grammar): an error, not an output
            failed = {req.request_id for req, _ in failures}
            outputs = [out for out in outputs if out.request_id not in failed]
            for req, why in failures:
                if self.hooks.on_failed is not None:
                    self.hooks.on_failed(req)
                self._deliver(req.request_id, GrammarFailedError(why))
        self._publish(outputs)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        finished = [out for out in outputs if out.finished]
        if not finished:
            # Tokens only: hand them over before the bookkeeping, which must not delay them.
            self._send(outputs)
            self._report_stats()
            return
        # A request ends: its metrics are recorded before its client can see the end, so
        # whoever reads /metrics after a response finished sees that request counted.
        if self.hooks.on_finished is not None:
            for out in finished:
                self.hooks.on_finished(out)
        self._report_stats()
        self._send(outputs)

    def _send(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _report_stats(self) -> None:
        if self.hooks.on_stats is not None:
            self.hooks.on_stats(self.engine.stats())

    def _dispatch(self, outputs: list[RequestOutput]) -> None:  # on the event loop
        for out in outputs:
            sink = self._streams.get(out.request_id)
            if sink is not None:
                self._hand(out.request_id, sink, out, finished=out.finished)

    def _deliver(self, request_id: str, exc: BaseException) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._put_error, request_id, exc)

    def _put_error(self, request_id: str, exc: BaseException) -> None:  # on the event loop
        sink = self._streams.get(request_id)
        if sink is not None:
            self._hand(request_id, sink, exc, finished=True)

    def _hand(
        self, request_id: str, sink: OutputSink, item: RequestOutput | BaseException, finished: bool
    ) -> None:
        """Give ``item`` to its consumer; a consumer that fails loses only its own request
        (the others of the step still get theirs)."""
        try:
            sink(item)
        except Exception:
            log.exception("the consumer of request %s failed; aborting it", request_id)
            self.release(request_id, abort=not finished)

    def _deliver_all(self, exc: BaseException) -> None:
        if self._loop is not None:
            for rid in list(self._streams):
                self._loop.call_soon_threadsafe(self._put_error, rid, exc)

    def _abort_all(self) -> None:
        outs = self.engine.abort_request(list(self.engine.requests))
        if outs:
            self._publish(outs)


class RequestStream:
    """The outputs of submitted requests (one, or the samples of one prompt), in order per
    request and interleaved as they arrive; each request's last output is finished.

    ``async for out in stream``; ``ready()`` takes the outputs that have already arrived
    without waiting (a consumer that fell behind sends them together). ``finished``: every
    request has given its last output, or one failed. ``close()`` is idempotent and aborts
    the requests that have not finished.

    Invariant: at most ``MERGE_AFTER`` outputs per request of the stream wait, in all (and
    the exception that ends it). An output that arrives when that many wait absorbs its
    request's latest waiting one (``RequestOutput.absorb``), so a client that stops
    reading holds a bounded number of outputs, the last ones growing with their text; the
    write-stall timeout (kvserve.openai.stalls) ends such a client.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str]) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self._running = set(request_ids)  # those whose last output has not been taken
        self._waiting: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._arrived = asyncio.Event()
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        return self._take(self._waiting.popleft())

    def put(self, item: RequestOutput | BaseException) -> None:
        """A request's next output or the exception that ends it (on the event loop)."""
        if isinstance(item, RequestOutput) and len(self._waiting) >= MERGE_AFTER * len(
            self.request_ids
        ):
            for i in range(len(self._waiting) - 1, -1, -1):  # its latest waiting output
                last = self._waiting[i]
                if isinstance(last, RequestOutput) and last.request_id == item.request_id:
                    del self._waiting[i]  # (its later outputs are the others')
                    item = item.absorb(last)
                    break
        self._waiting.append(item)
        self._arrived.set()

    def ready(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        while not self.finished and self._waiting:
            outs.append(self._take(self._waiting.popleft()))
        return outs

    def _take(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self._running.discard(item.request_id)
            self.finished = not self._running
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for request_id in self.request_ids:
                self._engine.release(request_id, abort=request_id in self._running)
