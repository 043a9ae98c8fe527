"""spec.inferencePool on the real control plane (tests/cluster), the operator running as
its ServiceAccount: without the inferencepools permission, then without GIE's CRD, the
model says so in its Ready condition (and its pods still roll out); with both, the API
server accepts the rendered InferencePool (GIE v1.3.0's CRD, vendored in
tests/cluster/crds), its selector finds the model's pods, status reports it and copies
what a gateway writes in the pool's status; turned off, the pool is deleted.

No gateway or endpoint picker runs here: what Envoy and an EPP make of the pool is not
tested (docs/inference-model.md says so).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvserve_operator.constants import (
    INFERENCE_POOL_CRD_NAME,
    INFERENCE_POOL_GROUP,
    INFERENCE_POOL_PLURAL,
)
from kvserve_operator.render import POOL_LABEL
from tests.cluster.controlplane import Cluster
from tests.support.inference_models import get_object, inference_model
from tests.support.operator_process import OPERATOR_NS, OPERATOR_SA, OperatorProcess
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
GIE_CRD = REPO / "tests" / "cluster" / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
POOL_ROLE = REPO / "operator" / "kvserve_operator" / "manifests" / "rbac-inference-pool.yaml"
NS = "pool-models"
NAME = "llm"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}"


def get(cluster: Cluster, kind: str, name: str, ns: str = NS) -> dict[str, Any] | None:
    return get_object(cluster, kind, name, ns)


def ready_condition(cluster: Cluster) -> dict[str, Any]:
    im = get(cluster, "inferencemodel", NAME) or {}
    conditions = (im.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Ready"), {})


def wait_for(what: str, check: Any, operator: OperatorProcess, timeout: float = 60) -> Any:
    """``poll``, with the operator's log and the model's status in the failure."""
    try:
        return poll(what, check, timeout=timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator log (tail):\n{operator.logs()[-4000:]}") from None


def can_i(cluster: Cluster, verb: str) -> bool:
    """Whether the operator's ServiceAccount may ``verb`` InferencePools in NS. A
    SubjectAccessReview, because ``kubectl auth can-i`` cannot name the resource while
    its CRD is not installed."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": OPERATOR_USER,
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{OPERATOR_NS}"],
            "resourceAttributes": {
                "group": INFERENCE_POOL_GROUP,
                "resource": INFERENCE_POOL_PLURAL,
                "verb": verb,
                "namespace": NS,
            },
        },
    }
    out = cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review)).stdout
    return bool(json.loads(out)["status"].get("allowed"))


@pytest.fixture(scope="module")
def model(k8s_cluster: Cluster, operator: OperatorProcess) -> Any:
    """The InferenceModel with the pool on, before the permission or the CRD exists."""
    # Another module of the session may have installed the CRD: this one starts without.
    k8s_cluster.kubectl("delete", "crd", INFERENCE_POOL_CRD_NAME, "--ignore-not-found", "--wait")
    k8s_cluster.kubectl("create", "namespace", NS)
    body = inference_model(
        NAME,
        NS,
        replicas=2,
        resources={"gpus": 1},
        inferencePool={"enabled": True, "endpointPickerRef": {"name": "llm-epp"}},
    )
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    yield body
    # While the operator still runs: it removes its finalizer from the model.
    k8s_cluster.kubectl("delete", "im", NAME, "-n", NS, "--ignore-not-found", "--timeout=60s")
    k8s_cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
    k8s_cluster.kubectl("delete", "crd", INFERENCE_POOL_CRD_NAME, "--ignore-not-found", check=False)
    k8s_cluster.kubectl(
        "delete", "clusterrolebinding", "kvserve-operator-inference-pool", "--ignore-not-found"
    )


def test_api_server_refuses_a_pool_without_a_picker(k8s_cluster: Cluster, model: Any) -> None:
    bad = json.loads(json.dumps(model))
    bad["metadata"]["name"] = "no-picker"
    bad["spec"]["inferencePool"] = {"enabled": True}
    proc = k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert proc.returncode != 0
    assert "inferencePool.endpointPickerRef is required" in proc.stderr, proc.stderr


def test_without_the_permission_ready_says_forbidden(
    k8s_cluster: Cluster, model: Any, operator: OperatorProcess
) -> None:
    assert not can_i(k8s_cluster, "patch")  # manifests/rbac.yaml alone: no pools

    def forbidden() -> dict[str, Any] | None:
        ready = ready_condition(k8s_cluster)
        return ready if ready.get("reason") == "InferencePoolForbidden" else None

    ready = wait_for("Ready=False, InferencePoolForbidden", forbidden, operator)
    assert ready["status"] == "False"
    assert "operator.inferencePool.enabled=true" in ready["message"]
    # The rest of the model is rendered as usual: the pods roll out with the pool's label
    # and vLLM's metric names.
    deployment = get(k8s_cluster, "deployment", NAME)
    assert deployment is not None
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"][POOL_LABEL] == NAME
    args = template["spec"]["containers"][0]["args"]
    assert args[args.index("--metrics-compat") + 1] == "vllm"


def test_without_the_crd_ready_says_crd_missing(
    k8s_cluster: Cluster, model: Any, operator: OperatorProcess
) -> None:
    k8s_cluster.kubectl("apply", "-f", str(POOL_ROLE))
    k8s_cluster.kubectl(
        "create", "clusterrolebinding", "kvserve-operator-inference-pool",
        "--clusterrole=kvserve-operator-inference-pool",
        f"--serviceaccount={OPERATOR_NS}:{OPERATOR_SA}",
    )  # fmt: skip
    # The API server's authorizer learns of a new binding through its informers.
    poll("the binding to take effect", lambda: can_i(k8s_cluster, "patch"))
    assert can_i(k8s_cluster, "delete") and not can_i(k8s_cluster, "update")

    def missing() -> dict[str, Any] | None:
        ready = ready_condition(k8s_cluster)
        return ready if ready.get("reason") == "InferencePoolCRDMissing" else None

    ready = wait_for("Ready=False, InferencePoolCRDMissing", missing, operator)
    assert INFERENCE_POOL_CRD_NAME in ready["message"]
    assert "install the Gateway API Inference Extension's CRDs" in ready["message"]
    im = get(k8s_cluster, "inferencemodel", NAME)
    assert im is not None and "inferencePool" not in im["status"]
    # Reported, not retried as a failure: no ReconcileError.
    degraded = next(c for c in im["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] != "ReconcileError", degraded


def test_with_the_crd_the_api_server_accepts_the_pool(
    k8s_cluster: Cluster, model: Any, operator: OperatorProcess
) -> None:
    k8s_cluster.kubectl("apply", "--server-side", "-f", str(GIE_CRD))
    k8s_cluster.kubectl(
        "wait", "--for=condition=Established", f"crd/{INFERENCE_POOL_CRD_NAME}", "--timeout=60s"
    )

    # The drift timer applies the pool once the API server serves it.
    def ready() -> dict[str, Any] | None:
        im = get(k8s_cluster, "inferencemodel", NAME) or {}
        status = im.get("status") or {}
        return (
            im
            if ready_condition(k8s_cluster).get("status") == "True" and status.get("inferencePool")
            else None
        )

    im = wait_for("the model Ready with its pool", ready, operator, timeout=90)
    assert im["status"]["inferencePool"] == {"name": NAME, "parents": []}
    assert im["status"]["readyReplicas"] == 2

    pool = get(k8s_cluster, "inferencepool", NAME)
    assert pool is not None
    owner = pool["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"]) == ("InferenceModel", im["metadata"]["uid"])
    spec = pool["spec"]
    assert spec["targetPorts"] == [{"number": 8000}]
    assert spec["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "llm-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    # The pool's selector finds exactly the model's pods.
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    pods = json.loads(
        k8s_cluster.kubectl("get", "pods", "-n", NS, "-l", selector, "-o", "json").stdout
    )
    assert len(pods["items"]) == 2


def test_status_copies_what_a_gateway_reports(
    k8s_cluster: Cluster, model: Any, operator: OperatorProcess
) -> None:
    # What a gateway controller writes on a pool that its HTTPRoute uses.
    parents = {
        "status": {
            "parents": [
                {
                    "parentRef": {
                        "group": "gateway.networking.k8s.io",
                        "kind": "Gateway",
                        "name": "inference-gateway",
                        "namespace": NS,
                    },
                    "controllerName": "gateway.envoyproxy.io/gatewayclass-controller",
                    "conditions": [
                        {
                            "type": "Accepted",
                            "status": "True",
                            "reason": "Accepted",
                            "message": "accepted by the gateway",
                            "lastTransitionTime": "2026-12-01T12:00:00Z",
                            "observedGeneration": 1,
                        }
                    ],
                }
            ]
        }
    }
    k8s_cluster.kubectl(
        "patch", "inferencepool", NAME, "-n", NS, "--subresource=status", "--type=merge",
        "-p", json.dumps(parents),
    )  # fmt: skip

    def copied() -> list[dict[str, Any]]:
        im = get(k8s_cluster, "inferencemodel", NAME) or {}
        return list(((im.get("status") or {}).get("inferencePool") or {}).get("parents") or [])

    (parent,) = wait_for("status.inferencePool.parents", copied, operator)
    assert parent["parentRef"]["name"] == "inference-gateway"
    assert parent["controllerName"] == "gateway.envoyproxy.io/gatewayclass-controller"
    assert parent["conditions"][0]["type"] == "Accepted"
    assert parent["conditions"][0]["message"] == "accepted by the gateway"


def test_turning_the_pool_off_deletes_it(
    k8s_cluster: Cluster, model: Any, operator: OperatorProcess
) -> None:
    k8s_cluster.kubectl(
        "patch", "im", NAME, "-n", NS, "--type=merge",
        "-p", json.dumps({"spec": {"inferencePool": {"enabled": False}}}),
    )  # fmt: skip

    def gone() -> bool:
        im = get(k8s_cluster, "inferencemodel", NAME) or {}
        return get(k8s_cluster, "inferencepool", NAME) is None and "inferencePool" not in (
            im.get("status") or {}
        )

    wait_for("the pool deleted and out of status", gone, operator)
    deployment = get(k8s_cluster, "deployment", NAME)
    assert deployment is not None
    template = deployment["spec"]["template"]
    assert POOL_LABEL not in template["metadata"]["labels"]
    assert "--metrics-compat" not in template["spec"]["containers"][0]["args"]
