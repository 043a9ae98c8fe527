"""The benchmarks' streaming client against a canned HTTP/1.1 server: what it counts as a
text chunk, what it parses, and how it fails."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvserve.bench.sse_client import COMPLETIONS, ClientRecord, Connection, StreamPool


def event(text: str, finish: str | None = None) -> bytes:
    """One chat chunk, serialised as the servers do (``"finish_reason": null``)."""
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}
STREAM = [
    event("Hel"),
    event("lo") + event(" there"),  # two events in one chunk of the body
    event("!", "length"),  # the last token's text comes with the finish reason
    b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\n",
    b"data: [DONE]\n\n",
]


def chunked(parts: list[bytes]) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return head + body + b"0\r\n\r\n"


Handler = Callable[[bytes], bytes]


async def serve(answer: Handler, client: Callable[[str], Awaitable[Any]]) -> Any:
    """Answer every request on a loopback server with ``answer(request)``; run ``client``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed its connection
                return
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            writer.write(answer(head + await reader.readexactly(length)))
            await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await client(f"http://127.0.0.1:{port}")
    finally:
        server.close()


def stream_once(answer: Handler, *, keep_text: bool) -> ClientRecord:
    async def client(url: str) -> ClientRecord:
        async with Connection(url, "sk-key", keep_text=keep_text) as conn:
            return await conn.stream(COMPLETIONS, {"stream": True}, request_id="r-1")

    rec: ClientRecord = asyncio.run(serve(answer, client))
    return rec


@pytest.mark.parametrize("keep_text", [False, True])
def test_text_chunks_usage_and_finish(keep_text: bool) -> None:
    requests: list[bytes] = []

    def answer(request: bytes) -> bytes:
        requests.append(request)
        return chunked(STREAM)

    rec = stream_once(answer, keep_text=keep_text)
    assert rec.ok and rec.error is None and rec.finish_reason == "length"
    # Four events with text, in three reads: both ways of reading count the same.
    assert len(rec.chunk_times) == 4
    assert rec.first == rec.chunk_times[0] and rec.last == rec.chunk_times[-1]
    assert rec.send <= rec.chunk_times[0] and rec.ttft is not None and rec.ttft >= 0
    assert (rec.output_tokens, rec.prompt_tokens, rec.cached_tokens) == (3, 12, 8)
    assert rec.text == ("Hello there!" if keep_text else "")
    (request,) = requests
    assert b"authorization: Bearer sk-key\r\n" in request
    assert b"x-request-id: r-1\r\n" in request


def test_an_error_event_fails_the_request() -> None:
    error = b'data: {"error": {"message": "engine died"}}\n\n'
    rec = stream_once(lambda _: chunked([event("a"), error, b"data: [DONE]\n\n"]), keep_text=False)
    assert not rec.ok and rec.error == "error event: engine died"


def test_an_http_error_is_recorded_and_the_connection_reused() -> None:
    body = b'{"error": {"message": "invalid key"}}'
    refusal = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    answers = iter([refusal, chunked(STREAM)])

    async def client(url: str) -> tuple[ClientRecord, ClientRecord]:
        async with Connection(url) as conn:
            first = await conn.stream(COMPLETIONS, {})
            return first, await conn.stream(COMPLETIONS, {})

    refused, served = asyncio.run(serve(lambda _: next(answers), client))
    assert refused.error == 'HTTP/1.1 401 Unauthorized: {"error": {"message": "invalid key"}}'
    assert served.ok


def test_the_pool_keeps_the_order_of_the_requests_and_tags_them() -> None:
    seen: list[str] = []

    def answer(request: bytes) -> bytes:
        seen.append(request.split(b"x-request-id: ")[1].split(b"\r\n")[0].decode())
        return chunked(STREAM)

    async def client(url: str) -> tuple[float, list[ClientRecord]]:
        async with StreamPool(url, None, 3) as pool:
            return await pool.drain(COMPLETIONS, [{"n": i} for i in range(7)], tag="t")

    seconds, records = asyncio.run(serve(answer, client))
    assert seconds > 0 and len(records) == 7 and all(r.ok for r in records)
    assert sorted(seen) == sorted(f"t-{i}" for i in range(7))
