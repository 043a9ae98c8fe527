"""Stop work for a request when its client goes away (the engine server and the gateway
both need it: before a response starts, and while it streams).

One listener task per request waits for ``http.disconnect`` on the ASGI channel (which
works behind middleware) and cancels the request's own task; the work itself runs in
that task, not in a task of its own. Requests are the hot path of both servers, and a
task plus an ``asyncio.wait`` per request costs more than the listener alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Receive

T = TypeVar("T")


@dataclass
class Watch:
    disconnected: bool = False


@asynccontextmanager
async def cancel_on_disconnect(receive: Receive) -> AsyncIterator[Watch]:
    """Run the block, cancelled if the client disconnects meanwhile.

    That cancellation ends the block quietly and sets ``watch.disconnected``; any other
    cancellation (the server stopping) and every exception propagate.
    """
    task = asyncio.current_task()
    assert task is not None
    watch = Watch()

    async def listen() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        watch.disconnected = True
        task.cancel()

    listener = asyncio.ensure_future(listen())
    try:
        yield watch
    except asyncio.CancelledError:
        if not watch.disconnected or task.uncancel() > 0:
            raise
    finally:
        listener.cancel()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None (``work`` cancelled) if the client disconnects first.

    Exceptions from ``work`` propagate.
    """
    async with cancel_on_disconnect(request.receive):
        return await work
    return None
