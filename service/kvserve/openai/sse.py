"""Server-sent events: the streaming response and the per-chunk encoding, shared by the
engine server and the gateway.

Streaming is the hot path of both (one event per token per stream), so it is kept lean:

* ``EventStreamResponse`` sends ready-encoded bytes straight to the ASGI ``send`` from
  the request's own task, which a listener for ``http.disconnect`` cancels when the client
  leaves (Starlette's ``StreamingResponse`` spends an anyio task group per response and a
  re-encode per chunk). Its ``on_close`` runs however the response ends (finished,
  client gone, error, or the response never started), which is where the engine request
  is aborted. The chunk that ends with ``data: [DONE]`` ends the response in the same
  write.
* ``TextEvents`` encodes the common event, a text delta with no logprobs and no finish
  reason, by splicing the JSON-escaped text into the response's constant prefix and
  suffix, built once from the same ``openai_format`` builders (so the bytes are exactly
  those of ``sse(completion_chunk(...))``); any other event goes through ``encode_event``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvserve.openai import format as fmt
from kvserve.openai.disconnect import Watch, cancel_on_disconnect
from kvserve.openai.stalls import OpenStream, watchdog

_SENTINEL = "\x00kvserve-text\x00"
# A str as a JSON string literal, non-ASCII kept (the C function behind json.dumps).
_json_string = json.encoder.encode_basestring


def encode_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload``, as bytes for the socket."""
    return fmt.sse(payload).encode()


SSE_DONE = fmt.SSE_DONE.encode()


class TextEvents:
    """Fast encoding of one response's plain text deltas (see the module docstring)."""

    def __init__(self, ids: dict[str, Any], chat: bool, index: int = 0) -> None:
        """``index``: the choice whose deltas these are."""
        if chat:
            # The first chat delta carries the role; the later ones have this shape.
            template = fmt.chat_chunk(ids, _SENTINEL, None, None, first=False, index=index)
        else:
            template = fmt.completion_chunk(ids, _SENTINEL, None, None, index)
        prefix, suffix = fmt.sse(template).split(json.dumps(_SENTINEL, ensure_ascii=False))
        self._prefix, self._suffix = prefix.encode(), suffix.encode()

    def text(self, text: str) -> bytes:
        # What json.dumps(text, ensure_ascii=False) returns, without building an encoder.
        return self._prefix + _json_string(text).encode() + self._suffix


class EventStreamResponse(Response):
    """``text/event-stream`` from an async iterator of encoded events (see the module)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
        write_timeout: float | None = None,
    ) -> None:
        """``write_timeout``: end the response (as if the client had left) when one write
        waits longer than this for a client that stopped reading (``openai.stalls``)."""
        self.events = events
        self.on_close = on_close
        self.write_timeout = write_timeout
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with cancel_on_disconnect(receive) as watch:
                await self._stream(send, watch)
        except OSError:  # the client left while a write was under way
            pass
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _stream(self, send: Send, watch: Watch) -> None:
        stream: OpenStream | None = None
        if self.write_timeout is not None:
            task = asyncio.current_task()
            assert task is not None

            def stalled() -> None:  # ended as a disconnect: quietly, request aborted
                watch.disconnected = True
                task.cancel()

            stalls = watchdog()
            stream = stalls.open(self.write_timeout, stalled)
        clock = asyncio.get_running_loop().time
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                last = chunk.endswith(SSE_DONE)  # the last event: one write with the end
                if stream is not None:
                    stream.writing_since = clock()
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if stream is not None:
                    stream.writing_since = None
                if last:
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if stream is not None:
                stalls.close(stream)
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
