"""Many gateway requests over one ``GenerateMany`` call per replica.

A gRPC message costs the gateway about as much CPU as the HTTP chunk it becomes, and a
call per request means one message per request per engine step. On one long-lived
``GenerateMany`` call the replica sends one message per step for all of them, so the
gateway's gRPC cost per streamed token shrinks with the number of concurrent streams.

``Multiplexer.start`` gives each request an ``UpstreamRequest`` that reads like a
``grpc.aio`` unary-stream call: ``await read()`` returns the request's next output (a
``TaggedOutput`` with a ``delta`` or a ``final``) or ``grpc.aio.EOF`` after the final,
and raises ``grpc.aio.AioRpcError`` when the request fails (the engine refused it, the
call broke, its deadline passed); ``cancel()`` aborts it on the replica. One task reads
the call and hands each output to its request; a broken call fails every request on it,
and the next request opens a new call. ``Multiplexer.fail_unanswered`` ends the requests
that have had no output yet with UNAVAILABLE (and cancels them on the replica): for a
replica that stopped answering while its call stays open, which no read would notice
before the request's deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc

from kvserve.rpc import codec
from kvserve.rpc import engine_pb2 as pb

log = logging.getLogger("kvserve.gateway")

# Outputs a request may have waiting for its reader: a client that stops reading is ended
# by the write-stall timeout (kvserve.openai.stalls); this bounds what piles up before.
MAX_PENDING_OUTPUTS = 4096
# What one GenerateMany message carries at most, far below what the replica takes
# (kvserve.rpc.listen.MAX_MESSAGE_BYTES): a message over that would end the call and every
# tenant's requests on it. A single larger command still goes, alone.
BATCH_BYTES = 4 * 1024 * 1024


class ReplicaAnswered(grpc.aio.AioRpcError):  # type: ignore[misc]
    """The replica ended this request with an ``Error`` of its own: the request failed
    there, while the replica and its call go on serving the others. Any other
    ``AioRpcError`` from ``read()`` comes from the call (broken, replica gone) or from the
    gateway (deadline, cancel)."""


def rpc_error(
    code: grpc.StatusCode, details: str, error: pb.Error | None = None
) -> grpc.aio.AioRpcError:
    """The error a failed request raises; an engine's ``Error`` rides in its trailing
    metadata, as on a failed ``Generate`` call (``codec.error_fields`` reads it), and
    makes it a ``ReplicaAnswered``."""
    if error is None:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
    trailers = grpc.aio.Metadata(*codec.error_metadata(error))
    return ReplicaAnswered(code, grpc.aio.Metadata(), trailers, details)


class UpstreamRequest:
    """One request on a shared call (see the module docstring)."""

    def __init__(self, call: _SharedCall, tag: int, timeout: float) -> None:
        self._call = call
        self.tag = tag
        self._items: deque[Any] = deque()  # TaggedOutput, or the AioRpcError that ends it
        self._waiter: asyncio.Future[None] | None = None
        self._answered = False  # the replica has sent it an output
        self._ended = False  # its last item has arrived (or it was cancelled)
        self._drained = False  # ... and has been read
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(timeout, self._expire, timeout)

    async def read(self) -> Any:
        while not self._items:
            if self._drained:
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self._items.appendleft(item)  # every later read fails the same way
            raise item
        kind = item.WhichOneof("kind")
        if kind == "error":
            error = rpc_error(codec.status_code(item.error), item.error.message, item.error)
            self._items.appendleft(error)
            raise error
        if kind == "final":
            self._drained = True
        return item

    def __aiter__(self) -> UpstreamRequest:
        return self

    async def __anext__(self) -> Any:
        item = await self.read()
        if item is grpc.aio.EOF:
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        """Abort the request on the replica unless it has ended."""
        self._abort(rpc_error(grpc.StatusCode.CANCELLED, "cancelled by the gateway"))

    def fail_unanswered(self, error: grpc.aio.AioRpcError) -> bool:
        """End the request with ``error`` (and abort it on the replica) if the replica
        has sent it nothing yet; whether it did."""
        if self._answered or self._ended:
            return False
        self._abort(error)
        return True

    # ---- fed by the shared call ------------------------------------------------------
    def put(self, item: Any) -> None:
        if self._ended:
            return
        if not isinstance(item, BaseException):
            self._answered = True
        if isinstance(item, BaseException) or item.WhichOneof("kind") != "delta":
            self._end(item)
            return
        if len(self._items) >= MAX_PENDING_OUTPUTS:  # its reader (a client) fell this far behind
            self._abort(
                rpc_error(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the client fell {MAX_PENDING_OUTPUTS} outputs behind; request aborted",
                )
            )
            return
        self._items.append(item)
        self._wake()

    def _end(self, last: Any) -> None:
        self._ended = True
        self._items.append(last)
        self._deadline.cancel()
        self._call.forget(self.tag)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _expire(self, timeout: float) -> None:
        error = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"not finished within {timeout:g} s")
        self._abort(error)

    def _abort(self, error: grpc.aio.AioRpcError) -> None:
        if not self._ended:
            self._end(error)  # what the reader gets from now on
            self._call.send(pb.TaggedCommand(tag=self.tag, cancel=pb.Cancel()))


class _SharedCall:
    """One ``GenerateMany`` call and the requests open on it."""

    def __init__(self, stub: Any, address: str) -> None:
        self.address = address
        self.requests: dict[int, UpstreamRequest] = {}
        self.broken = False
        self._outbox: list[pb.TaggedCommand] = []
        self._outbox_ready = asyncio.Event()
        self._call = stub.GenerateMany(self._commands())
        self._reader = asyncio.create_task(self._read(), name=f"GenerateMany {address}")

    def send(self, command: pb.TaggedCommand) -> None:
        self._outbox.append(command)
        self._outbox_ready.set()

    def forget(self, tag: int) -> None:
        self.requests.pop(tag, None)

    def fail_unanswered(self, error: grpc.aio.AioRpcError) -> int:
        """``UpstreamRequest.fail_unanswered`` on each open request; how many it ended."""
        return sum(request.fail_unanswered(error) for request in list(self.requests.values()))

    async def _commands(self) -> AsyncIterator[pb.GenerateManyRequest]:
        """What the call sends, until it ends. grpc.aio reads this in a task of its own,
        which it cancels only when this side cancels the call: when the replica ends it,
        the generator must return by itself. Left waiting, it would be collected while
        suspended in ``wait()``, and the collector's ``aclose()`` of a running generator
        fails ("Task exception was never retrieved ... already running")."""
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            if self.broken:
                return
            # What piled up during the last write leaves in as few messages as fit.
            commands, self._outbox = self._outbox, []
            for batch in batches(commands, BATCH_BYTES):
                yield pb.GenerateManyRequest(commands=batch)

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError
        try:
            async for batch in self._call:
                for output in batch.outputs:
                    request = self.requests.get(output.tag)
                    if request is not None:
                        request.put(output)
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the replica ended the call")
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the channel")
        except Exception as exc:  # never leave requests waiting on a dead reader
            log.exception("GenerateMany reader for %s failed", self.address)
            error = rpc_error(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        self._end_commands()
        if self.requests:
            log.warning(
                "GenerateMany call to %s ended with %d requests open: %s %s",
                self.address,
                len(self.requests),
                error.code().name,
                error.details(),
            )
        for request in list(self.requests.values()):
            request.put(error)

    def _end_commands(self) -> None:
        """The call is over: nothing more goes out, and ``_commands`` returns."""
        self.broken = True
        self._outbox_ready.set()

    def close(self) -> None:
        self._end_commands()
        self._call.cancel()
        self._reader.cancel()


def batches(commands: list[pb.TaggedCommand], limit: int) -> list[list[pb.TaggedCommand]]:
    """``commands`` in order, cut into runs of at most ``limit`` serialized bytes each
    (a command larger than that makes a run of its own)."""
    if len(commands) <= 1:  # the common case: nothing to measure
        return [commands] if commands else []
    runs: list[list[pb.TaggedCommand]] = []
    size = 0
    for command in commands:
        # A repeated message field costs its length-prefix and tag: 16 bytes bound them.
        cost = command.ByteSize() + 16
        if not runs or size + cost > limit:
            runs.append([])
            size = 0
        runs[-1].append(command)
        size += cost
    return runs


class Multiplexer:
    """The requests a gateway sends to one replica, on one shared call at a time."""

    def __init__(self, stub: Any, address: str) -> None:
        self._stub = stub
        self.address = address
        self._call: _SharedCall | None = None
        self._next_tag = 0
        self.num_calls = 0  # calls opened so far (a new one after each broken one)

    def start(
        self, request: pb.GenerateRequest, timeout: float, metadata: Mapping[str, str]
    ) -> UpstreamRequest:
        """Send ``request`` to the replica; read its outputs from the result."""
        call = self._call
        if call is None or call.broken:
            call = self._call = _SharedCall(self._stub, self.address)
            self.num_calls += 1
        self._next_tag += 1
        upstream = UpstreamRequest(call, self._next_tag, timeout)
        call.requests[upstream.tag] = upstream
        call.send(pb.TaggedCommand(tag=upstream.tag, start=request, metadata=metadata))
        return upstream

    def fail_unanswered(self, why: str) -> int:
        """End the requests the replica has sent nothing yet with UNAVAILABLE ``why``,
        and cancel them there; how many. Those that have had output go on."""
        if self._call is None:
            return 0
        return self._call.fail_unanswered(rpc_error(grpc.StatusCode.UNAVAILABLE, why))

    def close(self) -> None:
        if self._call is not None:
            self._call.close()
            self._call = None
