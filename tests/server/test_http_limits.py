"""What a client may make a server hold before its request is read: a head too large is a
431, a head too slow a 408, a promised body that never arrives a 408, malformed HTTP a
400, each in the OpenAI error shape, and the connection closed. Against a real uvicorn
server on loopback with the protocol and middleware both servers run."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator

import pytest

from kvserve.openai.http_limits import HttpLimits
from tests.support.guarded_server import guarded_server

LIMITS = HttpLimits(max_head_bytes=4096, head_timeout=0.5, body_timeout=0.5)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with guarded_server(LIMITS, max_body_bytes=1 << 20) as chosen:
        yield chosen


def exchange(port: int, *parts: bytes, pause: float = 0.0) -> bytes:
    """Send ``parts`` (``pause`` seconds apart), then read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for part in parts:
            try:
                sock.sendall(part)
            except OSError:  # the server already answered and closed
                break
            time.sleep(pause)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def error_of(response: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


def test_a_normal_request_is_served(port: int) -> None:
    body = b'{"x": 1}'
    reply = exchange(
        port,
        b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body,
    )
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"bytes":8}')


def test_an_endless_header_is_refused_431(port: int) -> None:
    start = b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Long: "
    status, error = error_of(exchange(port, start, b"a" * 8192, b"a" * 8192))
    assert status == 431 and "4096 bytes" in str(error["message"])


def test_a_dribbled_head_is_refused_408(port: int) -> None:
    parts = [b"POST /echo HTTP/1.1\r\n", b"Host: x\r\n", b"X-A: 1\r\n", b"X-B: 2\r\n"]
    status, error = error_of(exchange(port, *parts, pause=0.3))
    assert status == 408 and "headers" in str(error["message"])


def test_a_promised_body_that_never_arrives_is_refused_408(port: int) -> None:
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 100\r\n\r\n"
    status, error = error_of(exchange(port, head, b'{"x":', pause=1.0))
    assert status == 408 and "body" in str(error["message"])


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n",  # a control character
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 5\r\n\r\n0\r\n\r\n",  # both length headers
        b"GARBAGE\r\n\r\n",
    ],
)
def test_malformed_http_is_a_400_in_the_openai_shape(port: int, request_bytes: bytes) -> None:
    status, error = error_of(exchange(port, request_bytes))
    assert status == 400 and str(error["message"]).startswith("malformed HTTP request")
    assert error["type"] == "invalid_request_error"


def test_a_megabyte_url_is_a_431(port: int) -> None:
    url = [b"GET /", *[b"a" * 8192] * 128, b" HTTP/1.1\r\n\r\n"]  # sent 8 KiB at a time
    status, _ = error_of(exchange(port, *url))
    assert status == 431


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param([b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Long: ", b"a" * 8192], id="431"),
        pytest.param([b"GARBAGE\r\n\r\n"], id="malformed-400"),
        pytest.param(
            [b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n"], id="413"
        ),
    ],
)
def test_refusals_before_the_app_carry_a_request_id_in_the_apps_json(
    port: int, parts: list[bytes]
) -> None:
    """Answers written by the protocol or the middleware, not the app, are serialised as
    the app's errors are (compact JSON) and carry an id, in the body and the header."""
    head, _, body = exchange(port, *parts).partition(b"\r\n\r\n")
    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    headers = {k.decode().lower(): v.decode() for k, v in fields.items()}
    error = json.loads(body)["error"]
    assert error["request_id"] == headers["x-request-id"], head
    assert body == json.dumps({"error": error}, separators=(",", ":")).encode()


def test_an_answer_before_the_body_is_read_closes_the_connection(port: int) -> None:
    """A chunked body past the limit is a 413 sent mid-body, and the server closes the
    connection (after a lingering second) while the client is still sending. Kept open,
    it read and dropped whatever followed, a chunked body without end, and no idle timer
    ran while bytes kept coming."""
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"a" * 64 * 1024)
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        reply = b""
        with pytest.raises(OSError):  # bounded: an endless body, until the server closes
            for _ in range(100_000):  # 6 GiB: far more than a second's worth
                sock.sendall(chunk)
                if select.select([sock], [], [], 0)[0]:
                    reply += sock.recv(65536)
    status, error = error_of(reply)
    assert status == 413 and "exceeds the limit" in str(error["message"])


def test_a_request_read_to_its_end_keeps_its_connection(port: int) -> None:
    body = b'{"x": 1}'
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for _ in range(2):  # the second request on the same connection
            sock.sendall(head + body)
            reply = sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200") and b"connection: close" not in reply
