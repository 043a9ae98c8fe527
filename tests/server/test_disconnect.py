"""``cancel_on_disconnect``: a client that leaves cancels the request's own task, quietly;
every other cancellation and exception still propagates."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvserve.openai.disconnect import cancel_on_disconnect


class Client:
    """The receive side of one ASGI request: a client that can leave."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def test_a_disconnect_ends_the_block_quietly_and_the_code_after_it_runs() -> None:
    async def main() -> tuple[bool, bool, int]:
        client = Client()
        started = asyncio.Event()
        reached_end_of_block = False

        async def handler() -> tuple[bool, bool]:
            nonlocal reached_end_of_block
            async with cancel_on_disconnect(client.receive) as watch:
                started.set()
                await asyncio.Event().wait()  # forever, unless cancelled
                reached_end_of_block = True
            return watch.disconnected, reached_end_of_block

        task = asyncio.ensure_future(handler())
        await started.wait()
        client.gone.set()
        disconnected, reached = await task
        return disconnected, reached, task.cancelling()

    assert asyncio.run(main()) == (True, False, 0)


def test_work_that_finishes_first_is_not_cancelled_and_leaves_no_listener() -> None:
    async def main() -> tuple[bool, int]:
        client = Client()
        async with cancel_on_disconnect(client.receive) as watch:
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # let the cancelled listener finish
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return watch.disconnected, len(others)

    assert asyncio.run(main()) == (False, 0)


def test_another_cancellation_and_errors_propagate() -> None:
    async def cancelled_from_outside() -> None:
        client = Client()
        started = asyncio.Event()

        async def handler() -> None:
            async with cancel_on_disconnect(client.receive):
                started.set()
                await asyncio.Event().wait()

        task = asyncio.ensure_future(handler())
        await started.wait()
        task.cancel()  # the server stopping, say
        with pytest.raises(asyncio.CancelledError):
            await task

    async def failing() -> None:
        async with cancel_on_disconnect(Client().receive):
            raise ValueError("bad request")

    asyncio.run(cancelled_from_outside())
    with pytest.raises(ValueError, match="bad request"):
        asyncio.run(failing())
