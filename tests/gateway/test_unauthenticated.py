"""What a client without a valid key can make the gateway do: nothing but a 401. Its body
is never parsed, and the API description is not served unless the config asks."""

from __future__ import annotations

import httpx

from tests.support.gateway import Gateway, start_gateway
from tests.support.replicas import REPLICA_MODEL, Replica


def test_the_key_is_checked_before_the_body(gateway: Gateway) -> None:
    bad_bodies: list[dict[str, object]] = [
        {"content": b"{not json", "headers": {"content-type": "application/json"}},
        {"json": {"model": REPLICA_MODEL, "prompt": "x", "no_such_field": 1}},
        {"json": {"model": REPLICA_MODEL}},
    ]
    before = gateway.metric("kvserve_gateway_rejections_total", reason="invalid")
    for path in ("/v1/completions", "/v1/chat/completions"):
        for body in bad_bodies:
            r = httpx.post(gateway.url + path, **body)  # type: ignore[arg-type]
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "missing_api_key"
    assert gateway.metric("kvserve_gateway_rejections_total", reason="invalid") == before
    with gateway.client() as c:  # with a key, the same body gets its detailed 400
        r = c.post("/v1/completions", json=bad_bodies[1]["json"])
        assert r.status_code == 400 and r.json()["error"]["param"] == "no_such_field"


def test_the_api_description_is_off_by_default(gateway: Gateway) -> None:
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(gateway.url + path).status_code == 404, path


def test_the_api_description_can_be_turned_on(replicas: list[Replica]) -> None:
    gw = start_gateway(replicas, serve_api_docs=True)
    try:
        schema = httpx.get(gw.url + "/openapi.json")
        assert schema.status_code == 200
        assert "/v1/chat/completions" in schema.json()["paths"]
        assert httpx.get(gw.url + "/docs").status_code == 200
    finally:
        gw.stop()
