"""What a client gets, and what becomes of the replica, when a request fails upstream:
the replica's error for that one request is a 500 (not retried; the replica stays in
rotation, so a client that can make its own request fail cannot take the replica from
everyone else), and the gateway's request timeout is a 504, mid-stream too. The replica
is the bench's stub (the engine's gRPC API with canned output), which answers a prompt
``stub:error:CODE`` with the engine's error of that status (``stub:late-error:CODE``
after one token)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.bench.stub_replica import ERROR_PROMPT, LATE_ERROR_PROMPT
from kvserve.gateway.config import GatewayConfig
from kvserve.sse_events import DONE, event_data
from tests.support.gateway import Gateway, keys_file, serve_gateway
from tests.support.stub_replica import stub_replica
from tests.support.waiting import wait_until

TIMEOUT_S = 2.0
STEP_MS = 20.0  # the stub's time between outputs: a long answer outlasts TIMEOUT_S


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with stub_replica(Path(tmp_path_factory.mktemp("stub")), step_ms=STEP_MS) as address:
        config = GatewayConfig.model_validate(
            {
                "models": {"m": {"replicas": [f"grpc://{address}"]}},
                "keys_file": "unused.yaml",
                "request_timeout_seconds": TIMEOUT_S,
            }
        )
        gw = serve_gateway(config, keys_file())
        yield gw
        gw.stop()


def test_a_request_that_fails_on_its_replica_is_a_500_and_the_replica_serves_on(
    gateway: Gateway,
) -> None:
    failing = {"model": "m", "prompt": f"{ERROR_PROMPT}INTERNAL", "max_tokens": 3}
    with gateway.client() as c:
        whole = c.post("/v1/completions", json=failing)
        streamed = c.post("/v1/completions", json={**failing, "stream": True})
        after = c.post("/v1/completions", json={**failing, "prompt": "hello"})
    for refused in (whole, streamed):
        assert refused.status_code == 500, refused.text
        error = refused.json()["error"]
        assert error["type"] == "server_error"
        assert error["message"] == "the replica failed on this request: the stub answers INTERNAL"
    assert after.status_code == 200, after.text
    assert gateway.metric("kvserve_gateway_retries_total", model="m") == 0
    assert [view.healthy for view in gateway.state.fleet.views("m")] == [True]
    assert gateway.metric("kvserve_gateway_requests_total", model="m", status="500") == 2


def test_a_replica_that_says_it_is_unavailable_is_taken_out_of_rotation(
    gateway: Gateway,
) -> None:
    """The control: UNAVAILABLE (draining, its engine dead) is the replica's state, and
    the replica is back in rotation once a load poll reaches it."""
    failing = {"model": "m", "prompt": f"{ERROR_PROMPT}UNAVAILABLE", "max_tokens": 3}
    with gateway.client() as c:
        refused = c.post("/v1/completions", json=failing)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "no_healthy_replica"
    assert "1 unhealthy" in refused.json()["error"]["message"]
    wait_until(lambda: all(view.healthy for view in gateway.state.fleet.views("m")), 30)


def whole_and_streamed(gateway: Gateway, body: dict[str, Any]) -> tuple[Any, list[str]]:
    """The response to ``body`` sent whole, and the events of the same request streamed."""
    with gateway.client() as c:
        whole = c.post("/v1/completions", json=body)
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = [data for line in r.iter_lines() if (data := event_data(line)) is not None]
    return whole, events


def test_the_request_timeout_is_a_504_whole_and_mid_stream(gateway: Gateway) -> None:
    long = {"model": "m", "prompt": "hello", "max_tokens": 10 * int(TIMEOUT_S * 1000 / STEP_MS)}
    whole, events = whole_and_streamed(gateway, long)
    assert whole.status_code == 504, whole.text
    assert whole.json()["error"]["code"] == "timeout"
    assert f"request timeout ({TIMEOUT_S:g} s)" in whole.json()["error"]["message"]
    *chunks, last_error, done = events
    assert done == DONE and chunks, events[-3:]
    assert all("choices" in json.loads(chunk) for chunk in chunks)
    assert json.loads(last_error)["error"]["code"] == "timeout", last_error
    # Counted when the stream's response closes, which may come just after its last byte.
    wait_until(
        lambda: gateway.metric("kvserve_gateway_requests_total", model="m", status="504") == 2
    )
    assert [view.healthy for view in gateway.state.fleet.views("m")] == [True]


def test_many_large_samples_go_upstream_without_breaking_the_shared_call(
    gateway: Gateway,
) -> None:
    """Each sample of an n > 1 request carries the whole request, and what piles up goes
    to the replica on one shared call: 40 samples of a 120 kB prompt used to make one
    message over gRPC's 4 MiB limit, which ended the call, every tenant's stream on it,
    and the replica's place in rotation."""
    steps = int(TIMEOUT_S * 1000 / STEP_MS) // 2  # well within the request timeout
    other = {"model": "m", "prompt": "hello", "max_tokens": steps, "stream": True}
    big = {"model": "m", "prompt": "x " * 60_000, "max_tokens": 2, "n": 40}
    with gateway.client() as c, c.stream("POST", "/v1/completions", json=other) as r:
        lines = r.iter_lines()
        assert r.status_code == 200 and event_data(next(lines)) is not None  # in flight
        answer = c.post("/v1/completions", json=big)
        events = [data for line in lines if (data := event_data(line)) is not None]
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 40
    assert events[-1] == DONE and not any('"error"' in e for e in events), events[-3:]
    assert [view.healthy for view in gateway.state.fleet.views("m")] == [True]


def test_a_request_the_engine_refuses_mid_generation_is_a_400(gateway: Gateway) -> None:
    """A structured-output grammar can fail on a later token: the engine's 400 (its
    INVALID_ARGUMENT) stays a 400 through the gateway, whole and as the stream's error."""
    failing = {"model": "m", "prompt": f"{LATE_ERROR_PROMPT}INVALID_ARGUMENT", "max_tokens": 5}
    whole, events = whole_and_streamed(gateway, failing)
    assert whole.status_code == 400, whole.text
    assert whole.json()["error"]["type"] == "invalid_request_error"
    *chunks, last_error, done = events
    assert done == DONE and chunks
    error = json.loads(last_error)["error"]
    assert error["type"] == "invalid_request_error", error
    assert error["message"] == "the stub answers INVALID_ARGUMENT"
    assert [view.healthy for view in gateway.state.fleet.views("m")] == [True]
