"""Refusals are answered at a bounded pace while good requests never wait: the pacer's
rule on a fake clock, then a real uvicorn server on loopback with the protocol and the
middleware both servers run, sharing one pacer."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvserve.openai.http_limits import HttpLimits
from kvserve.openai.refusal_pacing import RefusalPacer, is_refusal
from tests.support.guarded_server import guarded_server
from tests.support.waiting import wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_is_answered_at_once_then_one_refusal_per_interval() -> None:
    clock = FakeClock()
    pacer = RefusalPacer(per_second=10, burst=3, max_delay=1.0, clock=clock)
    assert [pacer.delay() for _ in range(3)] == [0.0, 0.0, 0.0]
    # Held ones take the next slots, 0.1 s apart.
    assert [round(pacer.delay(), 6) for _ in range(3)] == [0.1, 0.2, 0.3]
    clock.now += 10.0  # a quiet while gives the whole burst back
    assert [pacer.delay() for _ in range(3)] == [0.0, 0.0, 0.0]


def test_a_refusal_is_held_at_most_max_delay_and_takes_no_slot_then() -> None:
    clock = FakeClock()
    pacer = RefusalPacer(per_second=2, burst=1, max_delay=1.0, clock=clock)
    assert [pacer.delay() for _ in range(3)] == [0.0, 0.5, 1.0]
    assert [pacer.delay() for _ in range(5)] == [1.0] * 5  # past the horizon: capped
    clock.now += 1.0  # the slot at +1.5 s is the next one: 0.5 s from now
    assert pacer.delay() == 0.5


def test_pacing_off_and_bad_settings() -> None:
    off = RefusalPacer.at(0)
    assert all(off.delay() == 0.0 for _ in range(1000))
    assert RefusalPacer.at(100).burst == 100 and RefusalPacer.at(0.5).burst == 1
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="refusals per second"):
            RefusalPacer(per_second=bad)
    with pytest.raises(ValueError, match="burst"):
        RefusalPacer(per_second=1, burst=0)


def test_only_client_errors_are_refusals() -> None:
    statuses = (200, 204, 301, 400, 401, 404, 413, 429, 499, 500, 503)
    assert [s for s in statuses if is_refusal(s)] == [400, 401, 404, 413, 429, 499]


# ---- on a real server --------------------------------------------------------------------
INTERVAL = 2.0  # seconds between paced refusals


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    pacer = RefusalPacer(per_second=1 / INTERVAL, burst=1, max_delay=30.0)
    with guarded_server(HttpLimits(), max_body_bytes=1024, pacer=pacer) as chosen:
        yield chosen


def exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, then read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


ECHO = b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
REFUSALS = {
    404: b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",  # the app's
    413: b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n\r\n",  # middleware's
    400: b"GARBAGE\r\n\r\n",  # the protocol's
}


def test_refusals_from_every_layer_share_one_pace_and_good_requests_do_not_wait(
    port: int,
) -> None:
    answered: dict[int, tuple[float, bytes]] = {}

    def refuse(status: int) -> None:
        reply = exchange(port, REFUSALS[status])
        answered[status] = (time.monotonic(), reply)

    threads = [threading.Thread(target=refuse, args=(s,)) for s in REFUSALS]
    for t in threads:
        t.start()
    # Once one refusal is answered (the burst), the others are held for 2 and 4 s; a good
    # request sent now is answered at once, before the last of them.
    wait_until(lambda: len(answered) >= 1, timeout=60)
    good = exchange(port, ECHO)
    good_at = time.monotonic()
    for t in threads:
        t.join(timeout=60)
    assert status_of(good) == 200 and good.endswith(b'{"bytes":2}')
    assert len(answered) == 3
    for status, (_, reply) in answered.items():
        assert status_of(reply) == status, reply
        error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
        assert error["type"].endswith("_error") and error["message"], error
    times = sorted(at for at, _ in answered.values())
    assert good_at < times[-1], "a good request waited behind held refusals"
    # Three refusals take two slots after the burst's: at least ~2 intervals apart.
    assert times[-1] - times[0] >= 2 * INTERVAL - 0.5
