"""Streams whose client stopped reading: found and ended, on both servers.

A client that opens a stream and never reads makes the server's write wait forever once
the socket's buffers are full, while the request keeps running and its outputs pile up
behind the write. Each streaming response marks when a write starts and ends; one
watchdog task per event loop looks at the open streams once a second and ends any whose
current write has waited longer than its limit, as if the client had disconnected: the
response's ``on_close`` aborts the request (its KV blocks are freed, the abort counted)
and the connection is closed. The per-chunk cost is a clock read and two stores, which
the hot path of both servers can afford; a timer per write could not.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("kvserve.http")

DEFAULT_WRITE_STALL_SECONDS = 30.0
CHECK_INTERVAL_SECONDS = 1.0


@dataclass(eq=False)
class OpenStream:
    """One streaming response: when its current write started (None: not writing)."""

    limit: float
    on_stall: Callable[[], None]  # ends the response (cancels its task)
    writing_since: float | None = None
    stalled: bool = False


class StallWatchdog:
    """The open streams of one event loop, checked every ``CHECK_INTERVAL_SECONDS``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._open: set[OpenStream] = set()
        self._task: asyncio.Task[None] | None = None

    def open(self, limit: float, on_stall: Callable[[], None]) -> OpenStream:
        stream = OpenStream(limit, on_stall)
        self._open.add(stream)
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._run(), name="kvserve-stall-watchdog")
        return stream

    def close(self, stream: OpenStream) -> None:
        self._open.discard(stream)

    async def _run(self) -> None:
        while self._open:  # an idle server runs no task
            await asyncio.sleep(CHECK_INTERVAL_SECONDS)
            now = self._loop.time()
            for stream in list(self._open):
                since = stream.writing_since
                if since is not None and now - since > stream.limit:
                    stream.stalled = True
                    self._open.discard(stream)
                    log.warning(
                        "a client has not read its stream for %.0f s: ending it", now - since
                    )
                    stream.on_stall()


_WATCHDOGS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StallWatchdog] = (
    weakref.WeakKeyDictionary()
)


def watchdog() -> StallWatchdog:
    """The running event loop's watchdog."""
    loop = asyncio.get_running_loop()
    found = _WATCHDOGS.get(loop)
    if found is None:
        found = _WATCHDOGS[loop] = StallWatchdog(loop)
    return found
