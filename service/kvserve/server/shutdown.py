"""Graceful shutdown: drain in-flight requests before the server exits."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from types import FrameType

import uvicorn

from kvserve.server.state import ServerState

log = logging.getLogger("kvserve.server")


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: stop admitting (readiness fails, new requests get 503), let
    in-flight requests finish for up to ``drain_timeout`` seconds, then abort what is
    left (each stream and answer ends with finish reason "abort"), shut down and exit 0.
    In flight are the engine's requests and those taken in and still on their way to it
    (``ServerState.preparing``: a batch of long prompts being tokenized, say).

    A second signal ends the drain now: the requests still running are aborted (their
    streams end with finish reason "abort") and the server shuts down as after a drain,
    quietly, with exit 0. (uvicorn's own second-signal exit cancels the lifespan and the
    open requests mid-await, which printed tracebacks and could abort the process in
    gRPC's threads.) A third signal exits at once with status 1.

    If the engine dies (``engine_died``; e.g. a tensor-parallel worker was lost) the
    server shuts down at once and ``exit_code`` is 1, so the pod is restarted.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_ended = False
        self.exit_code = 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded as a captured signal: uvicorn would re-raise it after shutdown,
        # and the process would die by the signal instead of exiting 0.
        if self._loop is None:
            self.should_exit = True
            return
        if self._drain_ended:
            log.warning("signal %d a third time: exiting at once", sig)
            os._exit(1)
        if self._draining:
            self._drain_ended = True
            log.warning(
                "signal %d again: ending the drain, aborting %d in-flight requests",
                sig,
                self.state.engine.num_in_flight,
            )
            self._loop.call_soon_threadsafe(self._end_drain)
            return
        self._draining = True
        self.state.admitting = False
        log.info(
            "signal %d: draining %d in-flight requests, %d API requests open (up to %.0f s)",
            sig,
            self.state.engine.num_in_flight,
            self.state.preparing,  # those on their way to the engine, and whole answers
            self.drain_timeout,
        )
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    def engine_died(self, exc: BaseException) -> None:  # in the engine thread
        log.error("the engine stopped (%s): shutting down with status 1", exc)
        self.exit_code = 1
        self.state.admitting = False
        self.should_exit = True

    def _end_drain(self) -> None:  # on the event loop
        self.state.engine.abort_all()
        self.should_exit = True

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # poll the in-flight count until the deadline
        if self.state.in_flight:
            log.warning(
                "drain timeout: aborting %d requests (%d API requests open)",
                self.state.engine.num_in_flight,
                self.state.preparing,
            )
        # As a second signal does: aborted, each request still gets its whole answer
        # (finish reason "abort") in uvicorn's grace period, where left running it would be
        # cancelled there (a plain-text 500, a stream cut off before [DONE]).
        self._end_drain()
