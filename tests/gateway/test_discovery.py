"""Kubernetes replica discovery: the snapshot logic on plain objects, then the watches
and the gateway against real Services and EndpointSlices from the test control plane
(the EndpointSlice controller builds the slices from kwok's fake pods)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvserve.gateway.config import GatewayConfig
from kvserve.gateway.discovery import DiscoveryState, KubernetesDiscovery, Snapshot
from tests.cluster.controlplane import Cluster
from tests.support.gateway import keys_file, serve_gateway
from tests.support.replicas import REPLICA_MODEL as MODEL
from tests.support.replicas import Replica
from tests.support.waiting import poll


def endpoint_slice(
    service: str, addresses: list[tuple[str, bool, bool]], port: int = 50051, ns: str = "a"
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{service}-x",
            "namespace": ns,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000}, {"name": "grpc", "port": port}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready, "terminating": terminating}}
            for ip, ready, terminating in addresses
        ],
    }


def service(name: str, served: str | None, ns: str = "a") -> dict[str, Any]:
    annotations = {"kvserve.dev/served-name": served} if served else {}
    return {"metadata": {"name": name, "namespace": ns, "annotations": annotations}}


def test_snapshot_has_ready_endpoints_under_the_served_name() -> None:
    state = DiscoveryState("grpc")
    state.apply("Service", "ADDED", service("llm", "llama-3.1-8b"))
    state.apply("Service", "ADDED", service("plain", None))
    state.apply(
        "EndpointSlice",
        "ADDED",
        endpoint_slice(
            "llm",
            [("10.0.0.1", True, False), ("10.0.0.2", False, False), ("10.0.0.3", True, True)],
        ),
    )
    state.apply("EndpointSlice", "ADDED", endpoint_slice("plain", [("10.0.0.9", True, False)]))
    # A slice whose Service has not been seen (yet) is not routable.
    state.apply("EndpointSlice", "ADDED", endpoint_slice("unknown", [("10.0.0.7", True, False)]))
    assert state.snapshot() == {"llama-3.1-8b": ["10.0.0.1:50051"], "plain": ["10.0.0.9:50051"]}

    state.apply("Service", "DELETED", service("llm", "llama-3.1-8b"))
    assert state.snapshot() == {"plain": ["10.0.0.9:50051"]}


def test_slices_without_the_port_or_in_ipv6() -> None:
    state = DiscoveryState("grpc")
    state.apply("Service", "ADDED", service("s", "m"))
    no_port = endpoint_slice("s", [("10.0.0.1", True, False)])
    no_port["ports"] = [{"name": "http", "port": 8000}]
    state.apply("EndpointSlice", "ADDED", no_port)
    assert state.snapshot() == {"m": []}
    v6 = endpoint_slice("s", [("fd00::5", True, False)])
    v6["addressType"] = "IPv6"
    state.apply("EndpointSlice", "MODIFIED", v6)
    assert state.snapshot() == {"m": ["[fd00::5]:50051"]}


@pytest.mark.parametrize("served", ["two words", "line\nbreak", "tab\there", "*"])
def test_a_service_whose_served_name_is_not_a_model_name_is_left_out(
    served: str, caplog: pytest.LogCaptureFixture
) -> None:
    state = DiscoveryState("grpc")
    state.apply("Service", "ADDED", service("ok", "good-name"))
    state.apply("Service", "ADDED", service("bad", served))
    state.apply("EndpointSlice", "ADDED", endpoint_slice("bad", [("10.0.0.2", True, False)]))
    assert state.snapshot() == {"good-name": []}
    assert "Service a/bad left out: served model name" in caplog.text
    # Renamed to a valid name, it is routed; its old name is gone.
    state.apply("Service", "MODIFIED", service("bad", "fixed"))
    assert state.snapshot() == {"fixed": ["10.0.0.2:50051"], "good-name": []}
    state.apply("Service", "MODIFIED", service("bad", served))
    assert state.snapshot() == {"good-name": []}


def test_services_sharing_a_served_name_pool_their_replicas_and_are_named() -> None:
    state = DiscoveryState("grpc")
    state.apply("Service", "ADDED", service("llm", "llama", ns="team-a"))
    state.apply("Service", "ADDED", service("other", "qwen", ns="team-a"))
    assert state.shared_names() == {}
    state.apply("Service", "ADDED", service("llm", "llama", ns="team-b"))
    for ns, ip in (("team-a", "10.0.0.1"), ("team-b", "10.0.0.2")):
        state.apply("EndpointSlice", "ADDED", endpoint_slice("llm", [(ip, True, False)], ns=ns))
    assert state.snapshot() == {"llama": ["10.0.0.1:50051", "10.0.0.2:50051"], "qwen": []}
    assert state.shared_names() == {"llama": ["team-a/llm", "team-b/llm"]}
    state.apply("Service", "DELETED", service("llm", "llama", ns="team-b"))
    assert state.shared_names() == {}


def test_a_relist_replaces_what_was_known() -> None:
    state = DiscoveryState("grpc")
    state.apply("Service", "ADDED", service("s", "m", ns="a"))
    state.apply("Service", "ADDED", service("s", "m2", ns="b"))
    state.replace("Service", [], namespace="a")
    assert state.services == {("b", "s"): "m2"}


# ------------------------------------------------------------ on the real control plane

LABELS = {"app.kubernetes.io/managed-by": "kvserve-operator"}


def fake_engine(cluster: Cluster, ns: str, name: str, served: str, replicas: int) -> None:
    """A Service shaped like the operator's and a Deployment of kwok pods behind it."""
    objects = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": LABELS,
                "annotations": {"kvserve.dev/served-name": served},
            },
            "spec": {
                "selector": {"app": name},
                "ports": [
                    {"name": "http", "port": 8000, "targetPort": "http"},
                    {"name": "grpc", "port": 50051, "targetPort": "grpc"},
                ],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {
                        "containers": [
                            {
                                "name": "engine",
                                "image": "registry.example/kvserve:test",
                                "ports": [
                                    {"name": "http", "containerPort": 8000},
                                    {"name": "grpc", "containerPort": 50051},
                                ],
                            }
                        ]
                    },
                },
            },
        },
    ]
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"kind": "List", "apiVersion": "v1", "items": objects})
    )


@pytest.fixture(scope="module")
def discovery_ns(k8s_cluster: Cluster) -> str:
    k8s_cluster.kubectl("create", "namespace", "discovery")
    # Not labelled as a replica: must be ignored.
    k8s_cluster.kubectl(
        "create", "service", "clusterip", "unrelated", "--tcp=50051", "-n", "discovery"
    )
    return "discovery"


class Recorder:
    def __init__(self) -> None:
        self.snapshots: list[Snapshot] = []
        self.lock = threading.Lock()

    def __call__(self, snapshot: Snapshot) -> None:
        with self.lock:
            self.snapshots.append(snapshot)

    def latest(self) -> Snapshot | None:
        with self.lock:
            return self.snapshots[-1] if self.snapshots else None


def discovery_of(cluster: Cluster, ns: str, recorder: Recorder, **kw: Any) -> KubernetesDiscovery:
    """Discovery of the operator's Services in ``ns``, calling ``recorder``."""
    return KubernetesDiscovery(
        namespaces=[ns],
        label_selector="app.kubernetes.io/managed-by=kvserve-operator",
        port_name="grpc",
        on_change=recorder,
        kubeconfig=cluster.kubeconfig,
        **kw,
    )


@pytest.fixture
def watcher(k8s_cluster: Cluster, discovery_ns: str) -> Iterator[Recorder]:
    recorder = Recorder()
    # A 5 s watch timeout also exercises re-watching from the last version.
    discovery = discovery_of(k8s_cluster, discovery_ns, recorder, watch_timeout_seconds=5)
    discovery.start()
    yield recorder
    discovery.stop()


@pytest.mark.cluster
@pytest.mark.slow
def test_watch_follows_pods_becoming_ready_and_going_away(
    k8s_cluster: Cluster, discovery_ns: str, watcher: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    fake_engine(k8s_cluster, discovery_ns, "llm", "llama-3.1-8b", replicas=2)

    def replicas(n: int) -> Snapshot | None:
        snap = watcher.latest()
        return snap if snap is not None and len(snap.get("llama-3.1-8b", [])) == n else None

    snap = poll("2 discovered replicas", lambda: replicas(2))
    assert set(snap) == {"llama-3.1-8b"}  # the unlabelled Service is ignored
    assert all(a.endswith(":50051") and a.startswith("10.244.") for a in snap["llama-3.1-8b"])

    k8s_cluster.kubectl("scale", "deployment", "llm", "-n", discovery_ns, "--replicas=3")
    poll("3 discovered replicas", lambda: replicas(3))
    k8s_cluster.kubectl("scale", "deployment", "llm", "-n", discovery_ns, "--replicas=1")
    poll("1 discovered replica", lambda: replicas(1))

    # A second Service with the same served name: one model, pooled, and a warning.
    fake_engine(k8s_cluster, discovery_ns, "llm-copy", "llama-3.1-8b", replicas=1)
    poll("the second Service's replica pooled in", lambda: replicas(2))
    services = f"{discovery_ns}/llm, {discovery_ns}/llm-copy"
    assert f"served name 'llama-3.1-8b' is on 2 Services ({services})" in caplog.text
    for kind in ("service", "deployment"):
        k8s_cluster.kubectl("delete", kind, "llm-copy", "-n", discovery_ns)
    poll("back to 1 replica", lambda: replicas(1))

    k8s_cluster.kubectl("delete", "service", "llm", "-n", discovery_ns)
    poll("the model to disappear", lambda: watcher.latest() == {})
    k8s_cluster.kubectl("delete", "deployment", "llm", "-n", discovery_ns)


@pytest.mark.cluster
def test_stop_ends_threads_that_are_blocked_in_a_watch(k8s_cluster: Cluster) -> None:
    """A watch thread saw the stop only with the next event or the watch's timeout
    (60 s by default), so stop() gave up on it after 5 s: every gateway with discovery
    took 5 s more to exit. Now stop() closes the watches' connections."""
    ns = "discovery-stop"
    k8s_cluster.kubectl("create", "namespace", ns)
    recorder = Recorder()
    discovery = discovery_of(k8s_cluster, ns, recorder)  # the default 60 s watches
    discovery.start()
    try:
        # A Service seen through the watch: both threads are past their list, watching.
        fake_engine(k8s_cluster, ns, "llm", "llama-3.1-8b", replicas=1)
        poll(
            "the replica seen by the watches", lambda: (recorder.latest() or {}).get("llama-3.1-8b")
        )
    finally:
        discovery.stop()
    alive = [
        t.name for t in threading.enumerate() if t.name.startswith("discovery-") and ns in t.name
    ]
    assert alive == [], alive


@pytest.mark.cluster
@pytest.mark.slow
def test_gateway_adds_discovered_replicas_and_drains_removed_ones(
    k8s_cluster: Cluster, discovery_ns: str, shared_replicas: list[Replica]
) -> None:
    # One real replica (static, on loopback; the session's) keeps the gateway serving;
    # the discovered ones are kwok pods that cannot be reached, which is fine for
    # membership.
    static = shared_replicas[0]
    fake_engine(k8s_cluster, discovery_ns, "tiny", MODEL, replicas=2)
    fake_engine(k8s_cluster, discovery_ns, "other", "discovered-only", replicas=1)
    config = GatewayConfig.model_validate(
        {
            "models": {MODEL: {"replicas": [static.grpc_url], "max_tokens_ceiling": 64}},
            "discovery": {
                "kubernetes": {
                    "namespaces": [discovery_ns],
                    "kubeconfig": str(k8s_cluster.kubeconfig),
                }
            },
            "keys_file": "unused.yaml",
            "load_poll_seconds": 0.2,
        },
        strict=False,
    )
    gw = serve_gateway(config, keys_file())
    try:

        def addresses(model: str) -> dict[str, bool]:
            return {v.address: v.draining for v in gw.state.fleet.views(model)}

        poll("2 discovered + 1 static replicas", lambda: len(addresses(MODEL)) == 3)
        models = gw.client().get("/v1/models").json()["data"]
        assert {m["id"] for m in models} == {MODEL, "discovered-only"}

        # Requests keep working once the load poll has marked the unreachable discovered
        # replicas unhealthy (before that, a request routed to both of them in turn runs
        # out of retries: a 502, which is right, but not what this test is about).
        poll(
            "the unreachable replicas to be marked unhealthy",
            lambda: [v.healthy for v in gw.state.fleet.views(MODEL)].count(True) == 1,
        )
        r = gw.client().post(
            "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4}
        )
        assert r.status_code == 200, r.text

        static_address = static.grpc_url.removeprefix("grpc://")
        discovered = set(addresses(MODEL)) - {static_address}
        k8s_cluster.kubectl("scale", "deployment", "tiny", "-n", discovery_ns, "--replicas=0")
        poll(
            "the discovered replicas to be drained and removed",
            lambda: addresses(MODEL) == {static_address: False},
        )

        def in_flight_series() -> set[str]:
            text = gw.client().get("/metrics").text
            return {
                line.split('replica="')[1].split('"')[0]
                for line in text.splitlines()
                if line.startswith("kvserve_gateway_in_flight_requests{")
            }

        # A forgotten replica's in-flight gauge goes with it (it read its last count for
        # ever: 3 after a scale-down, in a review helper's run).
        poll(
            "the removed replicas' in-flight series to go",
            lambda: not discovered & in_flight_series(),
        )
        assert static_address in in_flight_series()
        states = {
            state: gw.metric("kvserve_gateway_replicas", model=MODEL, state=state)
            for state in ("healthy", "unhealthy", "draining")
        }
        assert states == {"healthy": 1, "unhealthy": 0, "draining": 0}
    finally:
        gw.stop()
        k8s_cluster.kubectl(
            "delete", "deployment,service", "tiny", "other", "-n", discovery_ns, check=False
        )
