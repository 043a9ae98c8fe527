"""Run work for a request unless its client goes away first (the engine server and the
gateway both need it for everything that happens before a response starts)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextlib import suppress
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None (and ``work`` cancelled) if the client disconnects first.

    Listens for ``http.disconnect`` on the ASGI channel, which works behind middleware;
    exceptions from ``work`` propagate.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return None
    return task.result()
