"""The operator end to end on the real control plane (tests/cluster), as its ServiceAccount.

kwok plays the kubelet: pods get scheduled onto fake GPU nodes and marked Ready, so the
Deployment controller, garbage collector and API-server validation are all real; only
the containers never run (the engine itself is tested elsewhere).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.cluster.controlplane import Cluster
from tests.support.inference_models import inference_model
from tests.support.operator_process import OPERATOR_NS, OPERATOR_SA, OperatorProcess
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def get(cluster: Cluster, kind: str, ns: str, name: str) -> dict[str, Any] | None:
    proc = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    if proc.returncode != 0:
        assert "NotFound" in proc.stderr, proc.stderr
        return None
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def apply(cluster: Cluster, obj: dict[str, Any], check: bool = True) -> Any:
    return cluster.kubectl("apply", "-f", "-", input=json.dumps(obj), check=check)


def condition(im: dict[str, Any] | None, type_: str) -> str | None:
    for c in ((im or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return str(c["status"])
    return None


def wait_ready(cluster: Cluster, ns: str, name: str, replicas: int) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        im = get(cluster, "inferencemodel", ns, name)
        status = (im or {}).get("status") or {}
        if (
            im is not None
            and condition(im, "Ready") == "True"
            and condition(im, "Progressing") == "False"
            and status.get("readyReplicas") == replicas
            and status.get("replicas") == replicas
            and status.get("observedGeneration") == im["metadata"]["generation"]
        ):
            return im
        return None

    try:
        return poll(f"{ns}/{name} Ready with {replicas} replicas", ready, timeout=90)
    except AssertionError as exc:
        state = cluster.kubectl(
            "get", "nodes,im,deploy,rs,pods", "-n", ns, "-o", "wide", check=False
        )
        im = get(cluster, "inferencemodel", ns, name)
        raise AssertionError(
            f"{exc}\n{state.stdout}{state.stderr}\nstatus: {json.dumps((im or {}).get('status'))}"
        ) from None


@pytest.fixture(scope="module")
def ns(k8s_cluster: Cluster, operator: OperatorProcess) -> Iterator[str]:
    k8s_cluster.kubectl("create", "namespace", "models")
    yield "models"
    # Before the operator stops (it holds the models' finalizers): later modules share
    # the control plane, and a gateway there watching every namespace must not find
    # these models' engines. The pods go first: the namespace controller, finding pods
    # in their termination grace period (the engines' drain time, 45 s and more), looks
    # again only after it, though kwok removes them at once (this teardown took 11-16 s
    # or 72 s, by which came first).
    k8s_cluster.kubectl("delete", "inferencemodels", "--all", "-n", "models", "--timeout=120s")
    k8s_cluster.kubectl("delete", "deployments", "--all", "-n", "models", "--timeout=120s")
    k8s_cluster.kubectl(
        "wait", "--for=delete", "pods", "--all", "-n", "models", "--timeout=120s", check=False
    )
    k8s_cluster.kubectl("delete", "namespace", "models", "--timeout=120s")


def test_invalid_specs_are_refused_by_the_api_server(k8s_cluster: Cluster, ns: str) -> None:
    cases = [
        ({"model": None}, "model"),
        ({"resources": {"gpus": -1}}, "gpus"),
        ({"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}, "minReplicas"),
        ({"model": {"source": "s3://bucket/x"}}, "source"),
        ({"engine": {"dtype": "int3"}}, "dtype"),
        ({"model": {"source": "hf://a/b", "servedName": "two words"}}, "servedName"),
        ({"resources": {"memory": "-1Gi"}}, "memory"),  # a pod may not request less than 0
        ({"autoscaling": {"enabled": True, "maxReplicas": 2, "target": 0.001}}, "target"),
    ]
    for spec, field in cases:
        obj = inference_model("bad", ns)
        obj["spec"].update(spec)
        if obj["spec"]["model"] is None:
            del obj["spec"]["model"]
        proc = apply(k8s_cluster, obj, check=False)
        assert proc.returncode != 0, f"{spec} was accepted"
        assert field in proc.stderr, proc.stderr
    assert get(k8s_cluster, "inferencemodel", ns, "bad") is None


def test_create_renders_children_and_reports_ready(k8s_cluster: Cluster, ns: str) -> None:
    apply(k8s_cluster, inference_model("llm", ns, replicas=2, resources={"gpus": 1}))
    im = wait_ready(k8s_cluster, ns, "llm", 2)

    deployment = get(k8s_cluster, "deployment", ns, "llm")
    assert deployment is not None
    owner = deployment["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "InferenceModel",
        "llm",
        im["metadata"]["uid"],
    )
    pod_spec = deployment["spec"]["template"]["spec"]
    engine = next(c for c in pod_spec["containers"] if c["name"] == "engine")
    assert engine["image"] == "registry.example/kvserve:test"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--served-model-name" in engine["args"]
    assert engine["args"][engine["args"].index("--served-model-name") + 1] == "tiny"
    assert pod_spec["initContainers"][0]["command"][:3] == ["kvserve", "model", "pull"]
    service = get(k8s_cluster, "service", ns, "llm")
    assert service is not None
    assert {p["name"] for p in service["spec"]["ports"]} >= {"http", "grpc", "metrics"}
    assert get(k8s_cluster, "poddisruptionbudget", ns, "llm") is not None
    assert im["status"]["endpoint"]["host"] == f"llm.{ns}.svc.cluster.local"

    pods = json.loads(
        k8s_cluster.kubectl(
            "get", "pods", "-n", ns, "-l", "app.kubernetes.io/instance=llm", "-o", "json"
        ).stdout
    )
    assert len(pods["items"]) == 2
    assert all(p["spec"]["nodeName"].startswith("gpu-node-") for p in pods["items"])

    table = k8s_cluster.kubectl("get", "im", "llm", "-n", ns).stdout
    assert "tiny" in table and "2" in table


def test_spec_changes_roll_out_and_status_follows(k8s_cluster: Cluster, ns: str) -> None:
    k8s_cluster.kubectl(
        "patch", "im", "llm", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"replicas": 3, "engine": {"maxNumSeqs": 32}}}),
    )  # fmt: skip
    wait_ready(k8s_cluster, ns, "llm", 3)
    deployment = get(k8s_cluster, "deployment", ns, "llm")
    assert deployment is not None
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "32"
    assert deployment["status"]["updatedReplicas"] == 3


def test_deleted_deployment_is_recreated(k8s_cluster: Cluster, ns: str) -> None:
    old = get(k8s_cluster, "deployment", ns, "llm")
    assert old is not None
    k8s_cluster.kubectl("delete", "deployment", "llm", "-n", ns, "--wait=false")

    def recreated() -> bool:
        new = get(k8s_cluster, "deployment", ns, "llm")
        return new is not None and new["metadata"]["uid"] != old["metadata"]["uid"]

    poll("the Deployment to be recreated", recreated, timeout=60)
    wait_ready(k8s_cluster, ns, "llm", 3)


def test_manual_scaling_of_the_deployment_is_reverted(k8s_cluster: Cluster, ns: str) -> None:
    k8s_cluster.kubectl("scale", "deployment", "llm", "-n", ns, "--replicas=1")

    def reverted() -> bool:
        d = get(k8s_cluster, "deployment", ns, "llm")
        return d is not None and d["spec"]["replicas"] == 3

    poll("the operator to restore 3 replicas", reverted, timeout=60)
    wait_ready(k8s_cluster, ns, "llm", 3)


def test_hand_edits_that_cannot_be_merged_are_undone(k8s_cluster: Cluster, ns: str) -> None:
    """A hand edit takes the fields it changed from the operator, and the operator's next
    apply then merged into an invalid object (422: two ports named http; minAvailable
    beside maxUnavailable), which it reported as an invalid spec for good. Such a
    Service or PDB is recreated from the spec."""
    port = [{"op": "replace", "path": "/spec/ports/0/port", "value": 8080}]
    k8s_cluster.kubectl("patch", "service", "llm", "-n", ns, "--type=json", "-p", json.dumps(port))
    budget = {"spec": {"maxUnavailable": None, "minAvailable": 1}}
    k8s_cluster.kubectl("patch", "pdb", "llm", "-n", ns, "--type=merge", "-p", json.dumps(budget))

    def restored() -> bool:
        service = get(k8s_cluster, "service", ns, "llm") or {}
        pdb = get(k8s_cluster, "pdb", ns, "llm") or {}
        im = get(k8s_cluster, "inferencemodel", ns, "llm") or {}
        ports = [p["port"] for p in service.get("spec", {}).get("ports", [])]
        conditions = {c["type"]: c["status"] for c in im.get("status", {}).get("conditions", [])}
        return (
            8080 not in ports
            and 8000 in ports
            and "minAvailable" not in pdb.get("spec", {})
            and conditions.get("Degraded") == "False"
        )

    poll("the operator to restore the Service and the PDB", restored, timeout=60)


def test_restarted_operator_converges_without_duplicates(
    k8s_cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    operator.stop()
    k8s_cluster.kubectl(
        "patch", "im", "llm", "-n", ns, "--type=merge", "-p", '{"spec": {"replicas": 2}}'
    )
    operator.start()
    wait_ready(k8s_cluster, ns, "llm", 2)
    names = k8s_cluster.kubectl(
        "get", "deployments,services,poddisruptionbudgets", "-n", ns, "-o", "name"
    ).stdout.split()
    assert sorted(names) == sorted(
        ["deployment.apps/llm", "service/llm", "poddisruptionbudget.policy/llm"]
    )


def test_status_reports_capacity_from_a_config_map(k8s_cluster: Cluster, ns: str) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
    }  # fmt: skip
    cm = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "llama-8b-config", "namespace": ns},
        "data": {"config.json": json.dumps(config)},
    }  # fmt: skip
    apply(k8s_cluster, cm)
    im = inference_model("sized", ns)
    im["spec"]["model"]["configMap"] = "llama-8b-config"
    apply(k8s_cluster, im)

    def capacity() -> dict[str, Any] | None:
        got = get(k8s_cluster, "inferencemodel", ns, "sized")
        return ((got or {}).get("status") or {}).get("capacity")

    cap = poll("status.capacity", capacity)
    # 2 (K and V) × 32 layers × 8 KV heads × 128 head dim × 2 bytes (bf16)
    assert cap["kvBytesPerToken"] == 131072
    assert cap["tokensPerReplica"] > 0
    k8s_cluster.kubectl("delete", "im", "sized", "-n", ns)


def test_autoscaling_follows_the_fed_queue_within_bounds(
    k8s_cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    autoscaling = {
        "enabled": True, "minReplicas": 1, "maxReplicas": 3, "metric": "queueDepth",
        "target": 2, "scaleUpStabilizationSeconds": 1, "scaleDownDelaySeconds": 3,
    }  # fmt: skip
    apply(k8s_cluster, inference_model("auto", ns, autoscaling=autoscaling))
    wait_ready(k8s_cluster, ns, "auto", 1)

    assert operator.feed is not None
    operator.feed.waiting["auto-"] = 10.0  # 10 queued per replica: wants 5, max is 3
    wait_ready(k8s_cluster, ns, "auto", 3)
    im = get(k8s_cluster, "inferencemodel", ns, "auto")
    assert im is not None
    assert im["status"]["autoscaling"]["desiredReplicas"] == 3
    # The per-replica average the target is compared with (it was the sum: 30).
    poll(
        "currentMetric 10.0 per replica",
        lambda: (
            (get(k8s_cluster, "inferencemodel", ns, "auto") or {})["status"]["autoscaling"][
                "currentMetric"
            ]
            == 10.0
        ),
    )
    events = k8s_cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", "involvedObject.name=auto", "-o", "json"
    ).stdout
    assert "Scaled" in events

    # Turned off, autoscaling forgets its decision; turned on again it starts at
    # minReplicas, not at the old peak (held for the whole scale-down delay).
    off = {"spec": {"replicas": 2, "autoscaling": {"enabled": False}}}
    k8s_cluster.kubectl("patch", "im", "auto", "-n", ns, "--type=merge", "-p", json.dumps(off))
    im = wait_ready(k8s_cluster, ns, "auto", 2)
    assert "autoscaling" not in im["status"], im["status"]
    operator.feed.waiting["auto-"] = 0.0
    on = {"spec": {"autoscaling": {**autoscaling, "scaleDownDelaySeconds": 3600}}}
    k8s_cluster.kubectl("patch", "im", "auto", "-n", ns, "--type=merge", "-p", json.dumps(on))
    wait_ready(k8s_cluster, ns, "auto", 1)
    d = get(k8s_cluster, "deployment", ns, "auto")
    assert d is not None and d["spec"]["replicas"] == 1


def test_a_child_the_api_server_refuses_is_an_invalid_spec_and_an_event(
    k8s_cluster: Cluster, ns: str
) -> None:
    """A field the CRD passes through as it is (a nodeSelector value) that the API server
    refuses in the Deployment: Degraded, a Warning Event, not retried; fixed, it runs."""
    placement = {"gpus": 1, "nodeSelector": {"pool": "not a label value!"}}
    bad = inference_model("refused", ns, resources=placement)
    apply(k8s_cluster, bad)

    def degraded() -> dict[str, Any] | None:
        im = get(k8s_cluster, "inferencemodel", ns, "refused")
        return im if condition(im, "Degraded") == "True" else None

    im = poll("refused Degraded", degraded, timeout=60)
    message = next(c["message"] for c in im["status"]["conditions"] if c["type"] == "Degraded")
    assert "nodeSelector" in message, message
    assert get(k8s_cluster, "deployment", ns, "refused") is None

    def warned() -> list[dict[str, Any]] | None:
        events = json.loads(
            k8s_cluster.kubectl(
                "get", "events", "-n", ns, "--field-selector", "involvedObject.name=refused",
                "-o", "json",
            ).stdout
        )["items"]  # fmt: skip
        found = [e for e in events if e["type"] == "Warning" and e["reason"] == "InvalidSpec"]
        return found or None

    (event,) = poll("an InvalidSpec Warning Event", warned, timeout=60)
    assert "nodeSelector" in event["message"], event
    fixed = {"spec": {"resources": {"nodeSelector": None}}}
    k8s_cluster.kubectl("patch", "im", "refused", "-n", ns, "--type=merge", "-p", json.dumps(fixed))
    wait_ready(k8s_cluster, ns, "refused", 1)
    k8s_cluster.kubectl("delete", "im", "refused", "-n", ns)


def test_deleting_the_model_garbage_collects_its_children(k8s_cluster: Cluster, ns: str) -> None:
    k8s_cluster.kubectl("delete", "im", "llm", "-n", ns)

    def gone() -> bool:
        out = k8s_cluster.kubectl(
            "get", "deployments,services,poddisruptionbudgets,pods", "-n", ns,
            "-l", "app.kubernetes.io/instance=llm", "-o", "name",
        ).stdout  # fmt: skip
        return out.strip() == ""

    poll("the children of llm to be garbage-collected", gone, timeout=90)


def test_operator_exports_its_metrics(operator: OperatorProcess) -> None:
    text = httpx.get(f"http://127.0.0.1:{operator.metrics_port}/metrics").text
    reconciles = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvserve_operator_reconciles_total{") and 'result="ok"' in line
    ]
    assert sum(reconciles) > 0
    assert "kvserve_operator_reconcile_duration_seconds_count" in text
    assert 'kvserve_operator_scale_events_total{direction="up"}' in text


def test_operator_rbac_is_least_privilege(k8s_cluster: Cluster) -> None:
    who = f"--as=system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}"
    allowed = [
        ("patch", "deployments.apps"),
        ("patch", "inferencemodels.kvserve.dev", "--subresource=status"),
        ("list", "pods"),
    ]
    denied = [
        ("get", "secrets"),
        ("delete", "nodes"),
        ("create", "clusterroles.rbac.authorization.k8s.io"),
        ("delete", "inferencemodels.kvserve.dev"),
    ]
    for args in allowed:
        answer = k8s_cluster.kubectl("auth", "can-i", *args, who, "-A", check=False).stdout
        assert answer.strip() == "yes", args
    for args in denied:
        answer = k8s_cluster.kubectl("auth", "can-i", *args, who, "-A", check=False).stdout
        assert answer.strip() == "no", args
