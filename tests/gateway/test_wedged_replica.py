"""A replica that takes a request and then answers nothing while its connection stays
open (a wedged engine; a stopped process until keepalive notices): once a load poll
marks it unhealthy, the requests it has sent nothing yet are retried on another replica
(and cancelled on it) instead of waiting out ``request_timeout_seconds``. One real
replica, and ``tests.support.wedged_replica``."""

from __future__ import annotations

import httpx
import pytest

from kvserve.gateway.config import GatewayConfig
from kvserve.gateway.keys import hash_key
from tests.support.gateway import keys_file, serve_gateway
from tests.support.replicas import REPLICA_MODEL, Replica
from tests.support.waiting import wait_until
from tests.support.wedged_replica import wedged_replica

# The client gives up long before the gateway's request timeout (600 s): without the
# retry, the request on the wedged replica fails the test with a read timeout.
CLIENT_TIMEOUT_S = 20.0
KEY = "sk-test-wedged"
TOKENS_PER_MINUTE = 100_000


@pytest.fixture(scope="module")
def replica(shared_replicas: list[Replica]) -> Replica:
    return shared_replicas[0]


def test_a_request_on_a_replica_that_stopped_answering_moves_to_another(
    replica: Replica,
) -> None:
    tenant = {
        "tenant": "wedged-test",
        "sha256": hash_key(KEY),
        "models": ["*"],
        "limits": {"max_concurrent": 4, "tokens_per_minute": TOKENS_PER_MINUTE},
    }
    with wedged_replica() as (address, wedged):
        config = GatewayConfig.model_validate(
            {
                "models": {REPLICA_MODEL: {"replicas": [replica.grpc_url, f"grpc://{address}"]}},
                "keys_file": "unused.yaml",
                # Two requests in a row: one goes to each replica, healthy until then.
                "routing": {"policy": "round_robin"},
                "request_timeout_seconds": 600,
                "load_poll_seconds": 0.2,
            }
        )
        gw = serve_gateway(config, keys_file(extra=(tenant,)))
        try:
            headers = {"authorization": f"Bearer {KEY}"}
            body = {"model": REPLICA_MODEL, "prompt": "hello", "max_tokens": 3}
            with httpx.Client(base_url=gw.url, headers=headers, timeout=CLIENT_TIMEOUT_S) as c:
                answers = [c.post("/v1/completions", json=body) for _ in range(2)]
            for answer in answers:
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["text"]
            assert gw.metric("kvserve_gateway_retries_total", model=REPLICA_MODEL) == 1
            # The wedged replica was told to drop the request it never answered.
            starts = [line for line in wedged.log.read_text().splitlines() if "start" in line]
            assert len(starts) == 1, wedged.tail()
            tag = starts[0].split()[1]
            wait_until(lambda: f"cancel {tag}" in wedged.log.read_text().splitlines())
            # Slot, tenant concurrency and token reservation settled once each: the
            # tenant is charged what the two answers used (its bucket does not refill
            # on the test gateway's fixed clock).
            used = sum(answer.json()["usage"]["total_tokens"] for answer in answers)
            state = gw.state

            def settled() -> bool:
                usage = state.limiter.usage("wedged-test")
                return (
                    not state.fleet.slots.snapshot()
                    and usage.in_flight == 0
                    and usage.tokens_available == TOKENS_PER_MINUTE - used
                )

            wait_until(settled)
        finally:
            gw.stop()
