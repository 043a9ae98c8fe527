"""spec.nodes > 1 on the real control plane (tests/cluster), the operator running as its
ServiceAccount: without the LeaderWorkerSet CRD the model is refused in its Ready
condition and nothing is rendered; with the CRD (sigs.k8s.io/lws's own, from its Go
module: tests/support/lws.py) the API server accepts the rendered LeaderWorkerSet by
server-side apply, the Service selects only its leaders, and status follows what the
LWS controller reports; back at one node the LeaderWorkerSet gives way to a Deployment.

No LWS controller runs here, so no group's pods are created: what the controller writes
in the LeaderWorkerSet's status is written by the test (as the InferencePool test writes
a gateway's), and the pods of a real group are tested with the engine (tests/parallel).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvserve_operator.constants import LWS_CRD_NAME
from kvserve_operator.render import selector_labels, worker_labels
from tests.cluster.controlplane import Cluster
from tests.support.inference_models import get_object, inference_model
from tests.support.lws import install_crd
from tests.support.operator_process import OperatorProcess
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "lws-models"
NAME = "big"


def get(cluster: Cluster, kind: str, name: str, ns: str = NS) -> dict[str, Any] | None:
    return get_object(cluster, kind, name, ns)


def condition(cluster: Cluster, type_: str, name: str = NAME) -> dict[str, Any]:
    im = get(cluster, "inferencemodel", name) or {}
    conditions = (im.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


def wait_for(what: str, check: Any, operator: OperatorProcess, timeout: float = 60) -> Any:
    """``poll``, with the operator's log in the failure."""
    try:
        return poll(what, check, timeout=timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator log (tail):\n{operator.logs()[-4000:]}") from None


def selected(labels: dict[str, str], selector: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.fixture(scope="module")
def model(k8s_cluster: Cluster, operator: OperatorProcess, lws_crd_file: Path) -> Any:
    """A model of two pods per replica, before the LeaderWorkerSet CRD exists."""
    k8s_cluster.kubectl("delete", "crd", LWS_CRD_NAME, "--ignore-not-found", "--wait")
    k8s_cluster.kubectl("create", "namespace", NS)
    body = inference_model(NAME, NS, replicas=2, nodes=2, resources={"gpus": 4})
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    yield body
    # While the operator still runs: it removes its finalizer from the models.
    k8s_cluster.kubectl("delete", "im", "--all", "-n", NS, "--timeout=60s")
    k8s_cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
    k8s_cluster.kubectl("delete", "crd", LWS_CRD_NAME, "--ignore-not-found", check=False)


def test_without_the_crd_the_model_is_refused(
    k8s_cluster: Cluster, model: Any, operator: OperatorProcess
) -> None:
    def refused() -> dict[str, Any] | None:
        ready = condition(k8s_cluster, "Ready")
        return ready if ready.get("reason") == "LeaderWorkerSetCRDMissing" else None

    ready = wait_for("Ready=False, LeaderWorkerSetCRDMissing", refused, operator)
    assert ready["status"] == "False"
    assert LWS_CRD_NAME in ready["message"] and "install LeaderWorkerSet" in ready["message"]
    # Nothing rendered: no Deployment in its place, no Service, no budget.
    for kind in ("deployment", "service", "poddisruptionbudget"):
        assert get(k8s_cluster, kind, NAME) is None, kind
    # Reported, not retried as a failure.
    assert condition(k8s_cluster, "Degraded").get("reason") != "ReconcileError"


def test_a_deployment_asked_to_become_a_group_still_counts_while_refused(
    k8s_cluster: Cluster, model: Any, operator: OperatorProcess
) -> None:
    """A model served by a Deployment whose spec asks for nodes: 2 without the CRD keeps
    its Deployment, and its status keeps counting that Deployment's replicas (it counted
    the missing LeaderWorkerSet's: 0 of everything, while the model served)."""
    name = "was-one"
    body = inference_model(name, NS, replicas=1, resources={"gpus": 4})
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(body))

    def status_of(reason: str | None) -> dict[str, Any] | None:
        status = (get(k8s_cluster, "inferencemodel", name) or {}).get("status") or {}
        ready = condition(k8s_cluster, "Ready", name)
        ok = status.get("readyReplicas") == 1 and (reason is None or ready.get("reason") == reason)
        return status if ok else None

    wait_for("one replica ready", lambda: status_of(None), operator)
    k8s_cluster.kubectl(
        "patch", "im", name, "-n", NS, "--type=merge", "-p", json.dumps({"spec": {"nodes": 2}})
    )
    status = wait_for(
        "refused, still counting the Deployment",
        lambda: status_of("LeaderWorkerSetCRDMissing"),
        operator,
    )
    assert status["replicas"] == 1 and status["availableReplicas"] == 1, status
    assert get(k8s_cluster, "deployment", name) is not None  # left as it was
    k8s_cluster.kubectl("delete", "im", name, "-n", NS, "--timeout=60s")


def test_the_api_server_accepts_the_leader_worker_set(
    k8s_cluster: Cluster, model: Any, operator: OperatorProcess, lws_crd_file: Path
) -> None:
    install_crd(k8s_cluster, lws_crd_file)

    # The drift timer applies it once the API server serves it.
    lws = wait_for("the LeaderWorkerSet", lambda: get(k8s_cluster, "lws", NAME), operator)
    im = get(k8s_cluster, "inferencemodel", NAME)
    assert im is not None
    owner = lws["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"]) == ("InferenceModel", im["metadata"]["uid"])
    spec = lws["spec"]
    assert spec["replicas"] == 2
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    for template in (leader, worker):
        (engine,) = template["spec"]["containers"]
        args = engine["args"]
        # 4 GPUs in each of 2 pods: 8 ranks, 4 per pod.
        assert args[args.index("--tensor-parallel-size") + 1] == "8"
        assert args[args.index("--nnodes") + 1] == "2"
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert leader["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert worker["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"
    # The Service (and so the gateway's EndpointSlices) and the budget, as stored.
    service = get(k8s_cluster, "service", NAME)
    pdb = get(k8s_cluster, "poddisruptionbudget", NAME)
    assert service is not None and pdb is not None
    assert selected(leader["metadata"]["labels"], service["spec"]["selector"])
    assert not selected(worker["metadata"]["labels"], service["spec"]["selector"])
    assert worker["metadata"]["labels"] == worker_labels(NAME)
    budget = pdb["spec"]["selector"]["matchLabels"]
    assert selected(leader["metadata"]["labels"], budget)
    assert selected(worker["metadata"]["labels"], budget)

    # No LWS controller: no group has started, and status says so.
    status = wait_for(
        "status of the LeaderWorkerSet",
        lambda: (
            condition(k8s_cluster, "Ready").get("reason") == "ReplicasNotReady"
            and get(k8s_cluster, "inferencemodel", NAME)
        ),
        operator,
    )["status"]
    assert status["readyReplicas"] == 0
    assert condition(k8s_cluster, "Ready")["message"] == "0/2 replicas ready"
    assert condition(k8s_cluster, "Progressing")["status"] == "True"


def test_status_follows_the_leader_worker_set(
    k8s_cluster: Cluster, model: Any, operator: OperatorProcess
) -> None:
    # What the LWS controller writes once both groups are up (LeaderWorkerSetStatus).
    groups = {
        "status": {
            "replicas": 2,
            "readyReplicas": 2,
            "updatedReplicas": 2,
            "hpaPodSelector": ",".join(f"{k}={v}" for k, v in selector_labels(NAME).items()),
            "conditions": [
                {
                    "type": "Available",
                    "status": "True",
                    "reason": "AllGroupsReady",
                    "message": "All replicas are ready",
                    "lastTransitionTime": "2026-12-01T12:00:00Z",
                }
            ],
        }
    }
    k8s_cluster.kubectl(
        "patch", "lws", NAME, "-n", NS, "--subresource=status", "--type=merge",
        "-p", json.dumps(groups),
    )  # fmt: skip

    def ready() -> dict[str, Any] | None:
        im = get(k8s_cluster, "inferencemodel", NAME) or {}
        ok = condition(k8s_cluster, "Ready").get("status") == "True"
        return im if ok and (im.get("status") or {}).get("readyReplicas") == 2 else None

    im = wait_for("the model Ready with 2 groups", ready, operator)
    assert im["status"]["availableReplicas"] == 2
    assert condition(k8s_cluster, "Progressing")["status"] == "False"
    assert condition(k8s_cluster, "Degraded")["status"] == "False"


def test_a_spec_whose_ranks_do_not_fit_the_pods_is_refused(
    k8s_cluster: Cluster, model: Any, operator: OperatorProcess
) -> None:
    bad = json.loads(json.dumps(model))
    bad["metadata"]["name"] = "odd"
    bad["spec"]["engine"] = {"tensorParallelSize": 3}
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(bad))

    def reported() -> dict[str, Any] | None:
        degraded = condition(k8s_cluster, "Degraded", "odd")
        return degraded if "tensorParallelSize" in degraded.get("message", "") else None

    degraded = wait_for("Degraded with the ranks' numbers", reported, operator)
    assert "3 ranks do not split over spec.nodes=2 pods" in degraded["message"]
    assert get(k8s_cluster, "lws", "odd") is None


def test_one_node_again_replaces_it_with_a_deployment(
    k8s_cluster: Cluster, model: Any, operator: OperatorProcess
) -> None:
    k8s_cluster.kubectl(
        "patch", "im", NAME, "-n", NS, "--type=merge",
        "-p", json.dumps({"spec": {"nodes": 1, "resources": {"gpus": 1}}}),
    )  # fmt: skip

    def swapped() -> dict[str, Any] | None:
        deployment = get(k8s_cluster, "deployment", NAME)
        return deployment if deployment and get(k8s_cluster, "lws", NAME) is None else None

    deployment = wait_for("a Deployment in place of the LeaderWorkerSet", swapped, operator)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "1"
    assert "--nnodes" not in args
