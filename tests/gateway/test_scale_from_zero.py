"""A model with no replica (scaled to zero): the gateway holds its requests until one
appears, up to the admission queue's timeout, and shows them as
``kvserve_gateway_held_requests`` (what the operator scales up on).

A real gateway (in-process, uvicorn in a thread) discovering the model from the test
control plane: a Service shaped like the operator's, with no ready endpoint. Then a real
replica process appears as discovery adds one when a pod becomes ready:
``Fleet.set_replicas`` on the gateway's event loop (a kwok pod serves nothing, and the
replica process listens on 127.0.0.1, not on a pod IP). tests/cluster/test_autoscaling.py
runs the whole path: a real engine pod becoming Ready in the EndpointSlice.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvserve.gateway.config import GatewayConfig
from tests.cluster.controlplane import Cluster
from tests.support.gateway import Gateway, keys_file, serve_gateway
from tests.support.product import metrics
from tests.support.replicas import REPLICA_MODEL, Replica
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "gateway-scale-from-zero"
BODY = {"model": REPLICA_MODEL, "prompt": "cold start", "max_tokens": 4, "temperature": 0}
HELD = "kvserve_gateway_held_requests"
REPLICAS = "kvserve_gateway_replicas"
WAIT = "kvserve_gateway_queue_wait_seconds"


@pytest.fixture(scope="module")
def scaled_to_zero(k8s_cluster: Cluster) -> Iterator[Cluster]:
    """The model's Service as the operator makes it, selecting no pod."""
    k8s_cluster.kubectl("create", "namespace", NS)
    service = model_service("tiny", REPLICA_MODEL)
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(service))
    yield k8s_cluster
    k8s_cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def model_service(name: str, served_name: str) -> dict[str, Any]:
    """A model's Service as the operator makes it, selecting no pod."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app.kubernetes.io/managed-by": "kvserve-operator"},
            "annotations": {"kvserve.dev/served-name": served_name},
        },
        "spec": {
            "selector": {"app": f"{name}-scaled-to-zero"},
            "ports": [{"name": "grpc", "port": 50051}],
        },
    }


def discovering_gateway(cluster: Cluster, queue_size: int, queue_timeout: float) -> Gateway:
    config = GatewayConfig.model_validate(
        {
            "discovery": {
                "kubernetes": {"namespaces": [NS], "kubeconfig": str(cluster.kubeconfig)}
            },
            "admission": {"queue_size": queue_size, "queue_timeout_seconds": queue_timeout},
            "keys_file": "unused.yaml",
            "load_poll_seconds": 0.2,
        },
        strict=False,
    )
    gw = serve_gateway(config, keys_file(), ready_path="/health")
    # Discovered: the model is served, with no replica.
    poll("the model discovered", lambda: REPLICA_MODEL in gw.state.model_names())
    assert not gw.state.fleet.has_replicas(REPLICA_MODEL)
    return gw


def add_replica(
    gw: Gateway, replica: Replica, model: str = REPLICA_MODEL, capacity: int = 8
) -> None:
    """What discovery does when the model's first pod becomes ready."""
    loop = gw.state.tasks[0].get_loop()
    address = replica.grpc_url.removeprefix("grpc://")
    loop.call_soon_threadsafe(gw.state.fleet.set_replicas, model, [address], capacity)


def model_series(gw: Gateway, model: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The gauges' series of ``model``, by metric name: (labels, value)."""
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for (name, labels), value in metrics(f"{gw.url}/metrics").items():
        if name in (HELD, REPLICAS) and dict(labels)["model"] == model:
            series.setdefault(name, []).append((dict(labels), value))
    return series


def replica_series(gw: Gateway, model: str) -> list[tuple[str, float]]:
    """The model's ``kvserve_gateway_replicas`` series: (state, value)."""
    return [(labels["state"], v) for labels, v in model_series(gw, model).get(REPLICAS, [])]


def post_on_thread(
    gw: Gateway, body: dict[str, Any] = BODY
) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []

    def run() -> None:
        with gw.client() as c:
            out.append(c.post("/v1/completions", json=body))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.fixture(scope="module")
def replica(shared_replicas: list[Replica]) -> Replica:
    return shared_replicas[0]


def test_a_request_is_held_until_the_first_replica_appears(
    scaled_to_zero: Cluster, replica: Replica
) -> None:
    # Room for one held request: the next one is refused as by a full queue.
    gw = discovering_gateway(scaled_to_zero, queue_size=1, queue_timeout=120)
    try:
        assert gw.metric(f"{WAIT}_count") == 0
        thread, out = post_on_thread(gw)
        poll("the request held", lambda: gw.metric(HELD, model=REPLICA_MODEL) == 1)
        with gw.client() as c:
            full = c.post("/v1/completions", json=BODY)
        assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
        assert gw.metric("kvserve_gateway_rejections_total", reason="queue_full") == 1
        assert gw.metric(f"{WAIT}_count") == 0  # not admitted yet
        add_replica(gw, replica)
        thread.join(timeout=120)
        (resp,) = out
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"]
        assert gw.metric(HELD, model=REPLICA_MODEL) == 0
        # The hold is the request's admission wait: one observation, above the 0 bucket.
        assert gw.metric(f"{WAIT}_count") == 1
        assert gw.metric(f"{WAIT}_bucket", le="0.0") == 0
        assert gw.metric(f"{WAIT}_sum") > 0
        # With a replica, the next request is not held.
        with gw.client() as c:
            assert c.post("/v1/completions", json=BODY).status_code == 200
        assert gw.metric(f"{WAIT}_bucket", le="0.0") == 1
    finally:
        gw.stop()


def test_a_hold_ends_at_the_queue_timeout_with_a_503(scaled_to_zero: Cluster) -> None:
    gw = discovering_gateway(scaled_to_zero, queue_size=4, queue_timeout=0.5)
    try:
        with gw.client() as c:
            resp = c.post("/v1/completions", json=BODY)
        assert resp.status_code == 503, resp.text
        error: dict[str, Any] = resp.json()["error"]
        assert error["code"] == "queue_timeout" and REPLICA_MODEL in error["message"], error
        assert resp.headers["retry-after"] == "1"
        assert gw.metric("kvserve_gateway_rejections_total", reason="queue_timeout") == 1
        assert gw.metric(HELD, model=REPLICA_MODEL) == 0
    finally:
        gw.stop()


def test_a_deleted_model_fails_its_held_requests_with_a_404_at_once(
    scaled_to_zero: Cluster,
) -> None:
    # Its InferenceModel deleted, the model's Service goes: the held request must not wait
    # for the queue timeout (120 s here) to get a 503 for a model that will never come.
    doomed = "doomed-model"
    scaled_to_zero.kubectl("apply", "-f", "-", input=json.dumps(model_service("doomed", doomed)))
    gw = discovering_gateway(scaled_to_zero, queue_size=4, queue_timeout=120)
    try:
        poll("the second model discovered", lambda: doomed in gw.state.model_names())
        thread, out = post_on_thread(gw, {**BODY, "model": doomed})
        poll("the request held", lambda: gw.metric(HELD, model=doomed) == 1)
        assert ("healthy", 0.0) in replica_series(gw, doomed)
        scaled_to_zero.kubectl("delete", "service", "doomed", "-n", NS)
        thread.join(timeout=60)
        assert not thread.is_alive(), "the held request still waits after its model was deleted"
        (resp,) = out
        assert resp.status_code == 404, resp.text
        error: dict[str, Any] = resp.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model", error
        assert "removed" in error["message"], error
        assert doomed not in gw.state.model_names()
        assert REPLICA_MODEL in gw.state.model_names()  # the other model is untouched
        with gw.client() as c:
            listed = [m["id"] for m in c.get("/v1/models").json()["data"]]
            again = c.post("/v1/completions", json={**BODY, "model": doomed})
        assert doomed not in listed and REPLICA_MODEL in listed
        assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
        # Its gauges are gone, not left at 0 (a dashboard would list the model forever).
        assert model_series(gw, doomed) == {}
    finally:
        gw.stop()
        scaled_to_zero.kubectl("delete", "service", "doomed", "-n", NS, check=False)


def test_a_deleted_model_fails_its_queued_requests_too(
    scaled_to_zero: Cluster, replica: Replica
) -> None:
    # A queued request whose model goes must not stay at the queue's head, where it would
    # hold up every model's requests until its own timeout.
    doomed = "doomed-queued"
    scaled_to_zero.kubectl(
        "apply", "-f", "-", input=json.dumps(model_service("doomed-queued", doomed))
    )
    gw = discovering_gateway(scaled_to_zero, queue_size=4, queue_timeout=120)
    try:
        poll("the second model discovered", lambda: doomed in gw.state.model_names())
        # A replica with no free slot (capacity 0 stands in for one busy with others).
        add_replica(gw, replica, doomed, capacity=0)
        poll("its replica added", lambda: gw.state.fleet.has_replicas(doomed))
        thread, out = post_on_thread(gw, {**BODY, "model": doomed})
        poll("the request queued", lambda: gw.metric("kvserve_gateway_queue_length") == 1)
        scaled_to_zero.kubectl("delete", "service", "doomed-queued", "-n", NS)
        thread.join(timeout=60)
        assert not thread.is_alive(), "the queued request still waits after its model went"
        (resp,) = out
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["code"] == "model_not_found"
        assert gw.metric("kvserve_gateway_queue_length") == 0
    finally:
        gw.stop()
        scaled_to_zero.kubectl("delete", "service", "doomed-queued", "-n", NS, check=False)
