"""Limits on what a client may make a server hold before its request is even read.

uvicorn's httptools protocol buffers a request's head (request line and headers) for as
long as it takes and however large it grows: four connections each sending 32 MB of one
unterminated header line grew a gateway by 190 MB, and a client that sends its head a
byte at a time holds a connection open forever. ``GuardedHttpToolsProtocol`` bounds both:

- a head larger than ``HttpLimits.max_head_bytes`` is answered 431 (in the OpenAI error
  shape) and the connection closed;
- a head not complete ``HttpLimits.head_timeout`` seconds after its first byte (or after
  the connection opened) is answered 408 and the connection closed.

Malformed HTTP that the parser refuses (control characters in a header, both
Transfer-Encoding and Content-Length, ...) is answered 400 in the OpenAI error shape too,
where uvicorn answers plain text. Like every error, each of these carries a request id
(minted here: the head was not read) in ``error.request_id`` and ``x-request-id``.

These refusals wait for their turn like the application's own (``RefusalPacer``), the
connection's reading paused meanwhile.

A body that is promised (Content-Length) but does not arrive is bounded by the
request-id middleware (``body_timeout``). A request answered before its body was read to
the end (a refusal: 401 before the body, 413 of a chunked body past the limit, 408) ends
its connection with a lingering close too: uvicorn would read and drop the rest of the
body for as long as it kept coming, with no idle timer running meanwhile (a chunked body
without end held a connection and a share of a core). Both servers run with these: ``kvserve serve``
(``--max-header-bytes``, ``--header-timeout``, ``--body-timeout``) and the gateway
(``listen:`` in its config).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvserve.openai.errors import error_json
from kvserve.openai.middleware import DEFAULT_BODY_TIMEOUT, new_request_id
from kvserve.openai.refusal_pacing import RefusalPacer

HEAD_END = b"\r\n\r\n"
# After a refusal the connection stays open this long, its input discarded, before it is
# closed: closing with unread input makes the kernel reset the connection, and the reset
# can destroy the refusal before the client reads it (a lingering close).
LINGER_SECONDS = 1.0


@dataclass(frozen=True)
class HttpLimits:
    max_head_bytes: int = 64 * 1024
    head_timeout: float = 10.0
    body_timeout: float = DEFAULT_BODY_TIMEOUT


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head limits above (``limits`` and ``pacer``
    are set by ``protocol_with``)."""

    limits = HttpLimits()
    pacer: RefusalPacer | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._in_head = True
        self._tail = b""  # the last bytes seen, for a head end split across reads
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a refusal: discard
        if self._in_head:
            seen = self._tail + data
            end = seen.find(HEAD_END)
            head_part = len(data) if end < 0 else max(0, end + len(HEAD_END) - len(self._tail))
            self._head_bytes += head_part
            self._tail = seen[-(len(HEAD_END) - 1) :]
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(
                    431,
                    f"request line and headers exceed {self.limits.max_head_bytes} bytes",
                )
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # the next request on a kept-alive connection
            self._start_head()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if cycle is not None and cycle.more_body and not self.transport.is_closing():
            self._linger()  # answered before the body ended: see the module docstring

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    # ---- helpers ---------------------------------------------------------------------
    def _start_head(self) -> None:
        self._in_head, self._head_bytes, self._tail = True, 0, b""
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._refuse(
                408, f"request line and headers not received within {self.limits.head_timeout:g} s"
            )

    def send_400_response(self, msg: str) -> None:
        """The parser refused the request (uvicorn's answer is plain text)."""
        self._refuse(400, f"malformed HTTP request: {msg}")

    def _refuse(self, status: int, message: str) -> None:
        """Answer in the OpenAI error shape and close (the request never started), when
        the pacer gives this refusal its turn."""
        self._stop_head_timer()
        self._refused = True
        delay = 0.0 if self.pacer is None else self.pacer.delay()
        if delay <= 0:
            self._answer(status, message)
            return
        self.transport.pause_reading()
        self.loop.call_later(delay, self._answer, status, message)

    def _answer(self, status: int, message: str) -> None:
        if self.transport.is_closing():
            return
        self.transport.resume_reading()  # discarded until the close (a lingering close)
        # The request never reached the middleware: its id is minted here (a client's
        # x-request-id may be in the very head that was refused).
        rid = new_request_id()
        body = error_json(status, message, request_id=rid)
        reason = {
            400: b"Bad Request",
            408: b"Request Timeout",
            431: b"Request Header Fields Too Large",
        }[status]
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"x-request-id: %s\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body), rid.encode())
            + body
        )
        self._linger()

    def _linger(self) -> None:
        """Send EOF, discard what still comes for LINGER_SECONDS, then close."""
        self._refused = True
        self._unset_keepalive_if_required()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, self.transport.close)


def protocol_with(
    limits: HttpLimits, pacer: RefusalPacer | None = None
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class to pass as uvicorn's ``http=``, with these limits, its refusals
    paced by ``pacer`` (the application's own, so that both share one pace)."""
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {"limits": limits, "pacer": pacer},
    )
