"""A minimal HTTP/1.1 client for streamed completions, for the gateway benchmarks.

The gateway benchmarks time servers, so their client must cost little: on a small
machine it shares a CPU with one of the processes it measures. httpx with a JSON parse
per event costs ~100 µs of CPU per streamed chunk, as much as the gateway itself. This
client writes each request in one write, reads the chunked body with asyncio streams,
and recognises a text delta without parsing it: ``"finish_reason": null`` is in every
event that carries a text delta and nothing else (completions and chat, engine server
and gateway, which send one event per chunk and no such event without text), and in no
other event. Only the events that end a stream are parsed (finish reason, usage, errors,
and the text the last one may carry).

Timing (``time.perf_counter``, as ``serving.ClientRecord``): ``send`` is stamped just
before the request's single write; a chunk is stamped when the read that returns it
completes, before anything is parsed.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

from kvserve.bench.serving import ClientRecord

TEXT_DELTA = b'"finish_reason": null'
# What ends one request as failed (and closes its connection).
_FAILURES = (
    OSError,
    ValueError,
    asyncio.IncompleteReadError,
    asyncio.LimitOverrunError,
)


class Connection:
    """One keep-alive connection to ``url`` (``http://host:port``); requests go one at a
    time. Reconnects after a failure."""

    def __init__(self, url: str, key: str | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"expected http://HOST:PORT, got {url!r}")
        self.host, self.port = parts.hostname, parts.port
        self._auth = b"" if key is None else b"authorization: Bearer " + key.encode() + b"\r\n"
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def stream(
        self, path: str, body: dict[str, Any], request_id: str | None = None
    ) -> ClientRecord:
        """POST ``body`` (``"stream": true``) and read the events: the record's
        ``error`` holds any failure (HTTP status and body, or the transport error)."""
        payload = json.dumps(body).encode()
        rid = b"" if request_id is None else b"x-request-id: " + request_id.encode() + b"\r\n"
        request = (
            b"POST " + path.encode() + b" HTTP/1.1\r\nhost: " + self.host.encode() + b"\r\n"
            b"content-type: application/json\r\n" + self._auth + rid + b"content-length: "
            + str(len(payload)).encode() + b"\r\n\r\n" + payload
        )  # fmt: skip
        rec = ClientRecord(send=time.perf_counter())
        try:
            if self._stream is None:
                self._stream = await asyncio.open_connection(self.host, self.port)
            reader, writer = self._stream
            rec.send = time.perf_counter()
            writer.write(request)
            await self._read(reader, rec)
        except _FAILURES as exc:
            rec.error = rec.error or f"{type(exc).__name__}: {exc}"
            self.close()
        if rec.chunk_times:
            rec.first, rec.last = rec.chunk_times[0], rec.chunk_times[-1]
        return rec

    async def _read(self, reader: asyncio.StreamReader, rec: ClientRecord) -> None:
        status = await reader.readuntil(b"\r\n")
        chunked, length = False, 0
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-length":
                length = int(value)
        if not status.startswith(b"HTTP/1.1 200") or not chunked:
            body = await reader.readexactly(length) if length else b""
            rec.error = f"{status.decode().strip()}: {body[:300].decode(errors='replace')}"
            if not length:  # where this answer ends is unknown: do not reuse the connection
                self.close()
            return
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            now = time.perf_counter()
            if size == 0:
                return
            for _ in range(data.count(TEXT_DELTA)):
                rec.chunk_times.append(now)
            if b'"finish_reason": "' in data or b'"usage"' in data or b'"error"' in data:
                _read_events(data, rec, now)

    def close(self) -> None:
        if self._stream is not None:
            self._stream[1].close()
            self._stream = None


def _read_events(data: bytes, rec: ClientRecord, now: float) -> None:
    """The finish reason, usage and errors in the events of one chunk, and the text a
    finishing event may carry (the engine server sends the last token's text with the
    finish reason)."""
    for line in data.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[len(b"data: ") :])
        if "error" in event:
            rec.error = f"error event: {event['error'].get('message')}"
        if event.get("usage"):
            rec.output_tokens = int(event["usage"]["completion_tokens"])
        for choice in event.get("choices", ()):
            if choice.get("finish_reason") is not None:
                rec.finish_reason = choice["finish_reason"]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    rec.chunk_times.append(now)
