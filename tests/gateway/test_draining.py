"""Replicas that drain or go down behind the gateway: a replica that got SIGTERM says so
in its load report, gets no new requests and finishes its streams; when no replica can
take a request, the client is told so at once (503 ``no_healthy_replica``), not after
the admission queue's timeout."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.rpc import engine_pb2 as pb
from tests.support.gateway import Gateway, start_gateway
from tests.support.grpc_engine import BLOCK_SIZE, Served, serve
from tests.support.replicas import REPLICA_MODEL as MODEL
from tests.support.replicas import Replica, start_replicas
from tests.support.waiting import wait_until

# Far longer than it takes the gateway to notice a drain (a load poll every 0.2 s) and
# the checks that follow: ~20 ms a token on CPU.
LONG_STREAM_TOKENS = 500
QUEUE_TIMEOUT = 20.0  # what a request used to wait before it was told anything
FAST = 5.0  # a refusal "at once": well under QUEUE_TIMEOUT, with room for a busy CI machine


@dataclass
class Stream:
    """A streaming completion read in a thread: its events, and how it ended."""

    gw: Gateway
    max_tokens: int
    started: threading.Event = field(default_factory=threading.Event)
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # "data: [DONE]" arrived
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "a long answer", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        try:
            with self.gw.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line.removeprefix("data: ")))
                        self.started.set()
        except BaseException as exc:  # shown by finish()
            self.error = exc
        finally:
            self.started.set()

    def finish(self, timeout: float = 120) -> list[dict[str, Any]]:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        if self.error is not None:
            raise self.error
        return self.events


def start_stream(gw: Gateway, max_tokens: int = LONG_STREAM_TOKENS) -> Stream:
    """A stream running on a replica (its first chunk has arrived)."""
    stream = Stream(gw, max_tokens)
    stream.thread = threading.Thread(target=stream.run, daemon=True)
    stream.thread.start()
    assert stream.started.wait(60) and stream.error is None, stream.error
    return stream


def serving(gw: Gateway, reps: list[Replica]) -> Replica:
    """The one replica with a request of the gateway in flight."""
    busy = [r for r in reps if gw.state.fleet.slots.in_flight(address(r))]
    assert len(busy) == 1, busy
    return busy[0]


def address(rep: Replica) -> str:
    return rep.grpc_url.removeprefix("grpc://")


def replicas_in(gw: Gateway, state: str) -> float:
    return gw.metric("kvserve_gateway_replicas", model=MODEL, state=state)


def routed_to(gw: Gateway, rep: Replica) -> float:
    return gw.metric("kvserve_gateway_routing_decisions_total", replica=address(rep))


def ended_normally(events: list[dict[str, Any]]) -> bool:
    """No error event, and the last one ends the choice at its ``max_tokens``."""
    return not any("error" in e for e in events) and (
        events[-1]["choices"][0]["finish_reason"] == "length"
    )


def timed_post(gw: Gateway) -> tuple[httpx.Response, float]:
    body = {"model": MODEL, "prompt": "anyone there?", "max_tokens": 2, "temperature": 0}
    started = time.monotonic()
    r = httpx.post(f"{gw.url}/v1/completions", json=body, headers=gw.headers, timeout=120)
    return r, time.monotonic() - started


def assert_refused_at_once(r: httpx.Response, took: float, states: str) -> None:
    assert r.status_code == 503, r.text
    assert took < FAST, f"refused after {took:.1f} s"
    error = r.json()["error"]
    assert error["code"] == "no_healthy_replica", error
    assert f"no healthy replica of {MODEL!r}" in error["message"], error
    assert states in error["message"], error
    assert int(r.headers["retry-after"]) >= 1


def gateway(reps: list[Replica], **overrides: Any) -> Gateway:
    """A gateway whose queue would hold a request QUEUE_TIMEOUT seconds, and whose model
    allows the long streams."""
    admission = {"queue_timeout_seconds": QUEUE_TIMEOUT}
    return start_gateway(
        reps, max_tokens_ceiling=LONG_STREAM_TOKENS, admission=admission, **overrides
    )


@pytest.fixture
def two_replicas(model_dir: Path) -> Iterator[list[Replica]]:
    """Replicas of this test alone: it stops them."""
    reps = start_replicas(model_dir, 2, "--drain-timeout", "120")
    yield reps
    for rep in reps:
        rep.stop()


# ---- the replica's side: its load report ----------------------------------------------------
@pytest.fixture(scope="module")
def engine(checkpoint_dir: Callable[[str], Path]) -> Iterator[LLMEngine]:
    cfg = EngineConfig(
        model=str(checkpoint_dir("llama")), dtype="float32", device="cpu", block_size=BLOCK_SIZE
    )
    yield LLMEngine(cfg)


def test_get_load_says_whether_the_replica_is_draining(engine: LLMEngine) -> None:
    admitting = [True]

    async def body(s: Served) -> None:
        assert not (await s.stub.GetLoad(pb.GetLoadRequest())).draining
        admitting[0] = False  # what SIGTERM does (kvserve.server.shutdown)
        assert (await s.stub.GetLoad(pb.GetLoadRequest())).draining

    serve(engine, body, admitting=lambda: admitting[0])


# ---- the gateway's side ---------------------------------------------------------------------
@pytest.mark.slow
def test_a_draining_replica_finishes_its_streams_and_gets_nothing_new(
    two_replicas: list[Replica],
) -> None:
    gw = gateway(two_replicas, routing={"policy": "round_robin"})
    try:
        first = start_stream(gw)
        doomed = serving(gw, two_replicas)
        (other,) = [r for r in two_replicas if r is not doomed]
        doomed.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: replicas_in(gw, "draining") == 1, timeout=30)
        assert replicas_in(gw, "healthy") == 1

        # New requests go to the other replica only; none is refused on the way.
        ready = httpx.get(f"{gw.url}/ready")
        assert ready.status_code == 200 and ready.json()["replicas"] == {MODEL: 1}
        before = routed_to(gw, doomed)
        for _ in range(4):
            r, _took = timed_post(gw)
            assert r.status_code == 200, r.text
        assert routed_to(gw, doomed) == before
        assert gw.metric("kvserve_gateway_upstream_errors_total") == 0

        # The last replica drains too: the gateway is not ready, and says why at once.
        second = start_stream(gw)
        assert serving(gw, [other]) is other
        other.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: replicas_in(gw, "draining") == 2, timeout=30)
        not_ready = httpx.get(f"{gw.url}/ready")
        assert not_ready.status_code == 503 and not_ready.json()["error"]["request_id"]
        assert_refused_at_once(*timed_post(gw), "2 draining")

        # What was in flight finishes, then each replica exits as a drained one does.
        assert ended_normally(first.finish())
        assert ended_normally(second.finish())
        for rep in two_replicas:
            assert rep.proc.wait(timeout=60) == 0, rep.proc.tail()
        wait_until(lambda: replicas_in(gw, "unhealthy") == 2, timeout=30)
        assert_refused_at_once(*timed_post(gw), "2 unhealthy")
        assert gw.metric("kvserve_gateway_rejections_total", reason="no_healthy_replica") == 2
        assert gw.metric("kvserve_gateway_rejections_total", reason="queue_timeout") == 0
    finally:
        gw.stop()


@pytest.mark.slow
def test_with_no_healthy_replica_a_request_is_refused_at_once(model_dir: Path) -> None:
    (rep,) = start_replicas(model_dir, 1)
    gw = gateway([rep])
    try:
        rep.stop()  # killed: not a drain
        wait_until(lambda: replicas_in(gw, "unhealthy") == 1, timeout=30)
        assert httpx.get(f"{gw.url}/ready").status_code == 503
        assert_refused_at_once(*timed_post(gw), "1 unhealthy")
    finally:
        gw.stop()
        rep.stop()


@pytest.mark.slow
def test_a_queued_request_is_refused_when_its_last_replica_goes_down(model_dir: Path) -> None:
    """Queued behind a busy replica, a request waits for its slot; once the replica is
    gone, it is refused then and there."""
    (rep,) = start_replicas(model_dir, 1)
    gw = gateway([rep], max_in_flight=1)
    try:
        busy = start_stream(gw)
        queued: list[tuple[httpx.Response, float]] = []
        waiter = threading.Thread(target=lambda: queued.append(timed_post(gw)), daemon=True)
        waiter.start()
        wait_until(lambda: gw.state.queue.queue_length == 1, timeout=30)
        killed_at = time.monotonic()
        rep.stop()
        waiter.join(timeout=QUEUE_TIMEOUT + 30)
        ((r, _took),) = queued
        assert time.monotonic() - killed_at < FAST
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica", r.text
        busy.finish()  # ended by the failure (an error event), not hung
    finally:
        gw.stop()
        rep.stop()
