"""Stop strings are bounded in number and length, by the gateway and by replicas alike,
and a request at the limits is served."""

from __future__ import annotations

import httpx
import pytest

from tests.support.gateway import Gateway
from tests.support.replicas import REPLICA_MODEL, Replica

BODY = {"model": REPLICA_MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        ([f"s{i}" for i in range(17)], "at most 16 stop strings"),
        (["ok", "x" * 257], "stop[1] has 257"),
        ("y" * 300, "stop[0] has 300"),
    ],
)
def test_stop_strings_over_the_limits_are_refused_naming_stop(
    gateway: Gateway, replicas: list[Replica], stop: list[str] | str, message: str
) -> None:
    body = {**BODY, "stop": stop}
    for r in (
        httpx.post(f"{gateway.url}/v1/completions", json=body, headers=gateway.headers),
        httpx.post(f"{replicas[0].http}/v1/completions", json=body, timeout=60),
    ):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "stop" and message in error["message"], error


def test_stop_strings_at_the_limits_are_served(gateway: Gateway) -> None:
    stop = [f"{i:02d}" + "z" * 254 for i in range(16)]
    body = {**BODY, "stop": stop}
    r = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=gateway.headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
