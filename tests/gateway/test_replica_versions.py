"""The gateway in front of a replica that predates a request field: what it would get
wrong silently, it refuses instead. The stand-in for such a replica is the bench's stub
(the engine's gRPC API with canned output), which reads only the fields it always did."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.gateway.config import GatewayConfig
from tests.support.gateway import Gateway, keys_file, serve_gateway
from tests.support.stub_replica import stub_replica


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with stub_replica(Path(tmp_path_factory.mktemp("stub"))) as address:
        config = GatewayConfig.model_validate(
            {"models": {"m": {"replicas": [f"grpc://{address}"]}}, "keys_file": "unused.yaml"}
        )
        gw = serve_gateway(config, keys_file())
        yield gw
        gw.stop()


def test_echo_on_a_replica_that_does_not_send_it_is_a_502(gateway: Gateway) -> None:
    body = {"model": "m", "prompt": "the cache keeps keys", "max_tokens": 3}
    with gateway.client() as c:
        plain = c.post("/v1/completions", json=body)
        echo = c.post("/v1/completions", json={**body, "echo": True})
        streamed = c.post("/v1/completions", json={**body, "echo": True, "stream": True})
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == " word" * 3
    for refused in (echo, streamed):
        assert refused.status_code == 502, refused.text
        assert "does not support echo" in refused.json()["error"]["message"]
    assert gateway.metric("kvserve_gateway_requests_total", model="m", status="502") == 2
    assert gateway.state.fleet.slots.total == 0
    assert httpx.get(f"{gateway.url}/ready").status_code == 200  # the replica is fine
