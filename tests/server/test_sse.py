"""Server-sent events: the fast text encoding and the streaming response's life cycle."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvserve.openai import format as fmt
from kvserve.openai.sse import SSE_DONE, EventStreamResponse, TextEvents, encode_event

TEXTS = ["", "hello", ' "quoted" \\ back', "line\nbreak\ttab", "héllo wörld ✈", "\x00\x1f", "}]"]


@pytest.mark.parametrize("text", TEXTS)
def test_text_events_are_the_bytes_of_the_general_encoder(text: str) -> None:
    ids = fmt.response_ids("req-1", "my-model", False, 1700000000)
    assert TextEvents(ids, chat=False).text(text) == encode_event(
        fmt.completion_chunk(ids, text, None, None)
    )
    chat_ids = fmt.response_ids("req-1", 'model "x"', True, 1700000000)
    assert TextEvents(chat_ids, chat=True).text(text) == encode_event(
        fmt.chat_chunk(chat_ids, text, None, None, first=False)
    )
    payload = TextEvents(ids, chat=False).text(text).decode()
    assert payload.startswith("data: ") and payload.endswith("\n\n")
    assert json.loads(payload[len("data: ") :])["choices"][0]["text"] == text


class Channel:
    """The ASGI side of one response: what was sent, and a client that can leave."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def run_response(response: EventStreamResponse, channel: Channel) -> None:
    scope = {"type": "http", "method": "GET", "path": "/", "headers": []}
    asyncio.run(response(scope, channel.receive, channel.send))  # type: ignore[arg-type]


def test_the_done_event_ends_the_response_in_the_same_write() -> None:
    closed: list[bool] = []

    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield b"data: 2\n\n" + SSE_DONE

    channel = Channel()
    run_response(EventStreamResponse(events(), on_close=lambda: closed.append(True)), channel)
    start, *bodies = channel.sent
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"cache-control", b"no-cache") in start["headers"]
    assert [(b["body"], b["more_body"]) for b in bodies] == [
        (b"data: 1\n\n", True),
        (b"data: 2\n\n" + SSE_DONE, False),
    ]
    assert closed == [True]


def test_a_client_that_leaves_stops_the_events_and_closes_once() -> None:
    closed: list[bool] = []
    finalised: list[bool] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: first\n\n"
            await asyncio.Event().wait()  # the engine has nothing more yet
            yield b"never"
        finally:
            finalised.append(True)

    channel = Channel()

    async def send(message: dict[str, Any]) -> None:
        channel.sent.append(message)
        if message.get("body") == b"data: first\n\n":
            channel.gone.set()  # the client reads one event and goes away

    async def main() -> None:
        response = EventStreamResponse(events(), on_close=lambda: closed.append(True))
        scope = {"type": "http", "method": "GET", "path": "/", "headers": []}
        await asyncio.wait_for(response(scope, channel.receive, send), timeout=10)  # type: ignore[arg-type]

    asyncio.run(main())
    assert [m.get("body") for m in channel.sent[1:]] == [b"data: first\n\n"]
    assert closed == [True] and finalised == [True]


def test_an_error_in_the_events_propagates_after_closing() -> None:
    closed: list[bool] = []

    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_response(EventStreamResponse(events(), on_close=lambda: closed.append(True)), Channel())
    assert closed == [True]


def test_a_client_gone_before_the_start_still_closes() -> None:
    closed: list[bool] = []

    async def events() -> AsyncIterator[bytes]:
        yield SSE_DONE

    async def broken_send(message: dict[str, Any]) -> None:
        raise OSError("connection reset")  # the socket is gone before the headers go out

    async def main() -> None:
        response = EventStreamResponse(events(), on_close=lambda: closed.append(True))
        scope = {"type": "http", "method": "GET", "path": "/", "headers": []}
        await response(scope, Channel().receive, broken_send)  # type: ignore[arg-type]

    asyncio.run(main())  # a client that left is not an error of the server
    assert closed == [True]
