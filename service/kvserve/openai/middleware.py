"""Pure ASGI middleware (it does not wrap the response stream, so handlers still see
``http.disconnect`` when a client goes away)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.openai.errors import error_json
from kvserve.openai.refusal_pacing import RefusalPacer, is_refusal

MAX_REQUEST_ID_LEN = 128
DEFAULT_BODY_TIMEOUT = 30.0  # seconds a body part may take to arrive


def valid_request_id(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID_LEN and value.isprintable() and value.isascii()


def new_request_id() -> str:
    """The id of a request whose client sent none (or one that was refused)."""
    return uuid.uuid4().hex


class RequestContextMiddleware:
    """Request ids (``x-request-id`` in, validated, echoed out), the body size limit, the
    body timeout (a body part that does not arrive within ``body_timeout`` seconds, from a
    client that promised a body and never sends it, is a 408), and the pace of refusals:
    with a ``pacer``, each 4xx answer waits for its turn (kvserve.openai.refusal_pacing)."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        on_error: Callable[[int], None] | None = None,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        pacer: RefusalPacer | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_error = on_error  # called with the status of each refusal (metrics)
        self.body_timeout = body_timeout
        self.pacer = pacer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id")
        if given is not None and not valid_request_id(given):
            rid = new_request_id()
            self._refused(400)
            await self._pace()
            await _send_error(
                send,
                400,
                rid,
                f"x-request-id must be 1-{MAX_REQUEST_ID_LEN} printable ASCII characters",
                "x-request-id",
            )
            return
        rid = given or new_request_id()
        scope.setdefault("state", {})["request_id"] = rid

        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            self._refused(413)
            await self._pace()  # the body unread meanwhile: the client's sending stalls
            # Then close the connection: reading and discarding the rest of an oversized
            # body would cost the server as much as taking it.
            await _send_error(
                send,
                413,
                rid,
                f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}",
                None,
                close=True,
            )
            return

        received = 0
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # only the disconnect is left to wait for: no timeout
                return await receive()
            message = await self._receive_in_time(receive)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_body_bytes:
                    self._refused(413)
                    raise _BodyTooLarge(self.max_body_bytes)
            return message

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                if is_refusal(message["status"]):
                    await self._pace()
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        await self.app(scope, limited_receive, send_with_id)

    async def _receive_in_time(self, receive: Receive) -> Message:
        """``receive()``, or a 408 when the body does not arrive in time. A timer that
        cancels this task is cheaper than ``asyncio.wait_for`` (a task per read)."""
        task = asyncio.current_task()
        assert task is not None
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(self.body_timeout, expire)
        try:
            return await receive()
        except asyncio.CancelledError:
            if expired and task.uncancel() == 0:
                self._refused(408)
                raise _BodyTimeout(self.body_timeout) from None
            raise
        finally:
            timer.cancel()

    def _refused(self, status: int) -> None:
        if self.on_error is not None:
            self.on_error(status)

    async def _pace(self) -> None:
        delay = 0.0 if self.pacer is None else self.pacer.delay()
        if delay > 0:
            await asyncio.sleep(delay)


class _BodyTimeout(HTTPException):
    """Raised by ``receive`` inside the app when the body stops arriving."""

    def __init__(self, timeout: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout:g} s")


class _BodyTooLarge(HTTPException):
    """Raised by ``receive`` inside the app, whose handler for HTTP errors answers it (a
    body without content-length that turns out too long)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


async def _send_error(
    send: Send, status: int, rid: str, message: str, param: str | None, *, close: bool = False
) -> None:
    body = error_json(status, message, param, rid)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", rid.encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
