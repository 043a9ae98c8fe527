"""The Reconciler in this process against the real API server (tests/cluster), with a
fake monotonic clock for the autoscaler: what status says about a refused spec, about
scaling as the Deployment controller reports it, and whose autoscaling history a tick
uses. kwok marks the pods Ready; their engine metrics come from a ``MetricsFeed``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import config as kube_config

from kvserve_operator.config import OperatorConfig
from kvserve_operator.kube import Kube
from kvserve_operator.reconcile import Reconciler, SpecInvalid
from tests.cluster.controlplane import Cluster
from tests.support.inference_models import get_object, inference_model
from tests.support.operator_process import MetricsFeed, install_operator_rbac
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "reconciler"
LOG = logging.getLogger("test-reconciler")


class Clock:
    """The autoscaler's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def feed() -> Iterator[MetricsFeed]:
    feed = MetricsFeed()
    yield feed
    feed.close()


@pytest.fixture(scope="module")
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="module")
def reconciler(k8s_cluster: Cluster, feed: MetricsFeed, clock: Clock) -> Iterator[Reconciler]:
    install_operator_rbac(k8s_cluster)  # the CRD
    k8s_cluster.kubectl("create", "namespace", NS)
    api = kube_config.new_client_from_config(config_file=str(k8s_cluster.kubeconfig))
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # the test's own CA
    config = OperatorConfig(metrics_url_template=feed.template)
    yield Reconciler(Kube(api, "kvserve-test"), config, monotonic=clock)
    k8s_cluster.kubectl("delete", "namespace", NS, "--wait=false")


def apply(cluster: Cluster, name: str, **spec: Any) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(inference_model(name, NS, **spec)))


def model(cluster: Cluster, name: str) -> dict[str, Any]:
    im = get_object(cluster, "inferencemodel", name, NS)
    assert im is not None, name
    return im


def condition(im: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in im["status"]["conditions"] if c["type"] == type_)


def ready_pods(cluster: Cluster, name: str, count: int) -> None:
    def ready() -> bool:
        pods = json.loads(
            cluster.kubectl(
                "get", "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={name}", "-o", "json"
            ).stdout
        )["items"]
        return count == sum(
            not p["metadata"].get("deletionTimestamp")
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions") or []
            )
            for p in pods
        )

    poll(f"{count} ready pods of {name}", ready)


def test_a_refused_spec_is_its_observed_generation(
    k8s_cluster: Cluster, reconciler: Reconciler
) -> None:
    """The operator acted on the generation it refused: status.observedGeneration says
    so, or a client waiting for it to equal metadata.generation would wait forever."""
    apply(k8s_cluster, "refused", resources={"nodeSelector": {"pool": "not a label value!"}})
    for generation, value in ((1, "not a label value!"), (2, "still not one!")):
        patch = {"spec": {"resources": {"nodeSelector": {"pool": value}}}}
        k8s_cluster.kubectl(
            "patch", "im", "refused", "-n", NS, "--type=merge", "-p", json.dumps(patch)
        )
        with pytest.raises(SpecInvalid, match="nodeSelector"):
            reconciler.reconcile(NS, "refused", "test", LOG)
        im = model(k8s_cluster, "refused")
        assert im["metadata"]["generation"] == generation
        assert im["status"]["observedGeneration"] == generation
        assert condition(im, "Degraded")["status"] == "True"


def test_scaling_up_is_not_reported_as_a_rollout(
    k8s_cluster: Cluster, reconciler: Reconciler
) -> None:
    apply(k8s_cluster, "scaled", replicas=1)
    reconciler.reconcile(NS, "scaled", "test", LOG)

    def rolled_out() -> bool:  # the first version (the operator reconciles on the events)
        reconciler.reconcile(NS, "scaled", "test", LOG)
        return condition(model(k8s_cluster, "scaled"), "Progressing")["status"] == "False"

    poll("the first rollout of scaled to complete", rolled_out)
    patch = {"spec": {"replicas": 3}}
    k8s_cluster.kubectl("patch", "im", "scaled", "-n", NS, "--type=merge", "-p", json.dumps(patch))
    seen: list[tuple[str, str]] = []

    def scaled() -> bool:
        reconciler.reconcile(NS, "scaled", "test", LOG)
        im = model(k8s_cluster, "scaled")
        progressing = condition(im, "Progressing")
        seen.append((progressing["status"], progressing["reason"]))
        return progressing["status"] == "False" and im["status"]["readyReplicas"] == 3

    poll("3 ready replicas, Progressing=False", scaled)
    assert ("True", "ScalingUp") in seen, seen
    assert all(reason != "RollingOut" for _, reason in seen), seen

    # A new template is a rollout from the reconcile that applies it on.
    patch = {"spec": {"engine": {"maxNumSeqs": 8}}}
    k8s_cluster.kubectl("patch", "im", "scaled", "-n", NS, "--type=merge", "-p", json.dumps(patch))
    reconciler.reconcile(NS, "scaled", "test", LOG)
    assert condition(model(k8s_cluster, "scaled"), "Progressing")["reason"] == "RollingOut"


def test_a_model_created_again_under_its_name_starts_its_history_afresh(
    k8s_cluster: Cluster, reconciler: Reconciler, feed: MetricsFeed, clock: Clock
) -> None:
    """The autoscaler's windows belong to one object (its UID): one deleted and created
    again under the same name observes its scale-up window in full before scaling."""
    autoscaling = {
        "enabled": True, "minReplicas": 1, "maxReplicas": 3, "metric": "queueDepth",
        "target": 2, "scaleUpStabilizationSeconds": 60, "scaleDownDelaySeconds": 60,
    }  # fmt: skip
    apply(k8s_cluster, "again", autoscaling=autoscaling)
    reconciler.reconcile(NS, "again", "test", LOG)
    ready_pods(k8s_cluster, "again", 1)
    feed.waiting["again-"] = 10.0  # wants 5 replicas: 3 at most
    for _ in range(6):  # 50 s of a sustained queue, not yet the whole window
        assert reconciler.autoscale(NS, "again", LOG) is None
        clock.now += 10
    old_uid = model(k8s_cluster, "again")["metadata"]["uid"]

    k8s_cluster.kubectl("delete", "im", "again", "-n", NS, "--wait=true")
    apply(k8s_cluster, "again", autoscaling=autoscaling)
    assert model(k8s_cluster, "again")["metadata"]["uid"] != old_uid
    reconciler.reconcile(NS, "again", "test", LOG)
    ready_pods(k8s_cluster, "again", 1)
    clock.now += 10  # 60 s since the old object's first tick; the new one's first
    assert reconciler.autoscale(NS, "again", LOG) is None
    record = model(k8s_cluster, "again")["status"]["autoscaling"]
    assert (record["desiredReplicas"], record["reason"]) == (1, "waiting for a sustained queue")


def test_a_name_too_long_for_a_leader_worker_set_is_refused_in_status(
    k8s_cluster: Cluster, reconciler: Reconciler
) -> None:
    """52 characters pass the CRD, but with spec.nodes > 1 the LeaderWorkerSet's worker
    pods would get labels over 63 characters: refused, said in status, nothing rendered."""
    name = "m" * 52
    apply(k8s_cluster, name, nodes=2, replicas=2)
    with pytest.raises(SpecInvalid, match="controller-revision-hash"):
        reconciler.reconcile(NS, name, "test", LOG)
    im = model(k8s_cluster, name)
    degraded = condition(im, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ReconcileError")
    assert "at most 50" in degraded["message"], degraded
    assert im["status"]["observedGeneration"] == im["metadata"]["generation"]
    assert get_object(k8s_cluster, "deployment", name, NS) is None
