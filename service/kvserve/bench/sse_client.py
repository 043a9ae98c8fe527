"""The benchmarks' one client: streamed completions over keep-alive HTTP/1.1
connections, at little CPU cost (docs/bench-methods.md, "The streaming client")."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from kvserve.bench.cpu import CpuUse, cpu_use
from kvserve.bench.timelines import Workload
from kvserve.sse_events import event_data, parse_event
from kvserve.telemetry import definitions

if TYPE_CHECKING:
    from kvserve.bench.processes import Proc

T = TypeVar("T")
MODEL_NAME = "bench-model"  # what every benchmark server serves its model as
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TEXT_DELTA = b'"finish_reason": null'
# What ends one request as failed (and closes its connection).
_FAILURES = (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)


@dataclass
class ClientRecord:
    """One streamed request as the client saw it (``time.perf_counter`` seconds)."""

    send: float
    first: float | None = None  # first chunk with visible text
    last: float | None = None  # last chunk with visible text
    chunk_times: list[float] = field(default_factory=list)  # of the chunks with text
    output_tokens: int = 0  # usage.completion_tokens
    prompt_tokens: int = 0  # usage.prompt_tokens
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    text: str = ""  # the reply, with keep_text only
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else definitions.ttft(self.send, self.first)


def ttfts(records: Sequence[ClientRecord]) -> list[float]:
    """The TTFTs of the requests that succeeded and showed text."""
    return [t for r in records if r.ok and (t := r.ttft) is not None]


def itls(records: Sequence[ClientRecord]) -> list[float]:
    """Every gap between consecutive text chunks of the requests that succeeded."""
    return [gap for r in records if r.ok for gap in definitions.itls(r.chunk_times)]


def text_chunks(records: Sequence[ClientRecord]) -> int:
    """The chunks with text of the requests that succeeded."""
    return sum(len(r.chunk_times) for r in records if r.ok)


def completion_body(prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed, greedy completion of exactly ``max_tokens`` tokens (``ignore_eos``)."""
    return {"model": MODEL_NAME, "prompt": prompt, **_greedy_stream(max_tokens)}


def chat_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A streamed, greedy chat completion of exactly ``max_tokens`` tokens."""
    return {"model": MODEL_NAME, "messages": messages, **_greedy_stream(max_tokens)}


def _greedy_stream(max_tokens: int) -> dict[str, Any]:
    usage = {"include_usage": True}
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": usage}  # fmt: skip


class Connection:
    """One keep-alive connection to ``url`` (``http://host:port``); requests go one at a
    time. Reconnects after a failure; closed when an ``async with`` ends."""

    def __init__(self, url: str, key: str | None = None, *, keep_text: bool = False) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"expected http://HOST:PORT, got {url!r}")
        self.host, self.port = parts.hostname, parts.port
        self.keep_text = keep_text
        self._auth = b"" if key is None else b"authorization: Bearer " + key.encode() + b"\r\n"
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

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
            if self.keep_text:
                _read_events(data, rec, now, keep_text=True)
                continue
            rec.chunk_times += [now] * data.count(TEXT_DELTA)
            if b'"finish_reason": "' in data or b'"usage"' in data or b'"error"' in data:
                _read_events(data, rec, now, keep_text=False)

    def close(self) -> None:
        if self._stream is not None:
            self._stream[1].close()
            self._stream = None


def _read_events(data: bytes, rec: ClientRecord, now: float, keep_text: bool) -> None:
    """The events of one chunk of the body: the finish reason, usage and errors, and the
    text of every event (``keep_text``) or else only of an event that ends the stream."""
    for line in data.split(b"\n"):
        payload = event_data(line)
        if payload is None or not payload.startswith("{"):
            continue
        event = parse_event(payload)
        if event.error is not None:
            rec.error = f"error event: {event.error}"
        if event.usage:
            rec.output_tokens = int(event.usage["completion_tokens"])
            rec.prompt_tokens = int(event.usage.get("prompt_tokens") or 0)
            details = event.usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = int(details.get("cached_tokens") or 0)
        if event.finish_reason is not None:
            rec.finish_reason = event.finish_reason
        if event.text and (keep_text or event.finish_reason is not None):
            rec.chunk_times.append(now)
            if keep_text:
                rec.text += event.text


class StreamPool:
    """``streams`` connections to one server that drain a list of requests together, each
    taking the next request when its last one ends (a closed loop, as clients behind a
    fixed number of streams send)."""

    def __init__(self, url: str, key: str | None, streams: int) -> None:
        self.url = url
        self.connections = [Connection(url, key) for _ in range(streams)]

    async def __aenter__(self) -> StreamPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for conn in self.connections:
            conn.close()

    async def warm_up(self, path: str, body: dict[str, Any]) -> None:
        """``body`` once on every connection, outside any timed window: the connections,
        and the first calls behind them. Raises RuntimeError when one fails."""
        warm = await asyncio.gather(*(c.stream(path, body) for c in self.connections))
        errors = [rec.error for rec in warm if rec.error]
        if errors:
            raise RuntimeError(f"warm-up request to {self.url} failed: {errors[0]}")

    async def drain(
        self, path: str, bodies: Sequence[dict[str, Any]], tag: str | None = None
    ) -> tuple[float, list[ClientRecord]]:
        """Send every body; returns the wall seconds and the records, in ``bodies``' order.
        With ``tag``, request ``i`` goes as request id ``{tag}-{i}``."""
        records: list[ClientRecord | None] = [None] * len(bodies)
        todo = iter(range(len(bodies)))

        async def worker(conn: Connection) -> None:
            for i in todo:
                rid = None if tag is None else f"{tag}-{i}"
                records[i] = await conn.stream(path, bodies[i], rid)

        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in self.connections[: len(bodies)]))
        seconds = time.perf_counter() - start
        done = [rec for rec in records if rec is not None]
        assert len(done) == len(bodies), "every request has its record"
        return seconds, done


@dataclass
class WorkloadPass:
    """One timed pass of a workload through a server."""

    seconds: float
    records: list[ClientRecord]  # in the workload's order
    cpu: CpuUse  # over the timed window, of this process and the watched children


async def stream_workload(
    url: str,
    key: str | None,
    work: Workload,
    streams: int,
    *,
    tag: str | None = None,
    children: Sequence[Proc] = (),
) -> WorkloadPass:
    """``streams`` connections (one request each to warm up, untimed) drain the
    workload's completions. With ``tag``, request ``i`` goes as request id ``{tag}-{i}``."""
    bodies = [completion_body(p, n) for p, n in zip(work.prompts, work.output_lens, strict=True)]
    async with StreamPool(url, key, min(streams, len(bodies))) as pool:
        await pool.warm_up(COMPLETIONS, completion_body(work.prompts[0], 2))
        with cpu_use(children) as cpu:
            seconds, records = await pool.drain(COMPLETIONS, bodies, tag)
    return WorkloadPass(seconds, records, cpu)


def run_on_uvloop(coro: Coroutine[Any, Any, T]) -> T:
    """Run a benchmark's clients (or stand-in server) on uvloop where it is installed, as
    the servers run (a slower client loop would be charged to the server)."""
    try:
        import uvloop
    except ImportError:  # not on Windows
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)
