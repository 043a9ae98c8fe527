"""The test control plane itself: GPU scheduling onto fake nodes and garbage collection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.controlplane import GPU_NODES, Cluster
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_server_version_is_stamped(k8s_cluster: Cluster) -> None:
    version = json.loads(k8s_cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
    assert version["serverVersion"]["minor"].isdigit()


def test_gpu_deployment_runs_on_a_fake_gpu_node_and_is_garbage_collected(
    k8s_cluster: Cluster,
) -> None:
    ns = "smoke"
    k8s_cluster.kubectl("create", "namespace", ns)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gpu-job", "namespace": ns},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "gpu-job"}},
            "template": {
                "metadata": {"labels": {"app": "gpu-job"}},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "example.invalid/engine:1",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ]
                },
            },
        },
    }
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(deployment))

    def ready_pod() -> dict | None:  # type: ignore[type-arg]
        pods = json.loads(k8s_cluster.kubectl("get", "pods", "-n", ns, "-o", "json").stdout)
        for pod in pods["items"]:
            conditions = pod.get("status", {}).get("conditions", [])
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                return pod  # type: ignore[no-any-return]
        return None

    pod = poll("a Ready pod", ready_pod)
    assert pod["spec"]["nodeName"] in GPU_NODES

    k8s_cluster.kubectl("delete", "deployment", "gpu-job", "-n", ns, "--wait=false")

    def no_pods() -> bool:
        out = k8s_cluster.kubectl("get", "pods,replicasets", "-n", ns, "-o", "name").stdout
        return out.strip() == ""

    poll("the ReplicaSet and pods to be garbage-collected", no_pods)


def test_fake_nodes_renew_their_leases(k8s_cluster: Cluster) -> None:
    # Without lease renewals the node lifecycle controller marks the nodes NotReady after
    # its grace period, and then every pod Ready=False for good (kwok does not undo it).
    def renewed() -> bool:
        out = k8s_cluster.kubectl("get", "leases", "-n", "kube-node-lease", "-o", "json").stdout
        leases = {i["metadata"]["name"]: i["spec"] for i in json.loads(out)["items"]}
        return all(leases.get(n, {}).get("renewTime") for n in GPU_NODES)

    poll("node leases renewed by kwok", renewed, timeout=30)


def test_the_by_hand_scripts_run_from_any_directory(tmp_path: Path) -> None:
    """docs/test-cluster.md's `tests/cluster/up` and `down` import the control plane from
    any working directory (they once failed on `import tests`). `down` with a state dir
    that does not exist imports everything and stops nothing."""
    script = Path(__file__).resolve().parent / "down"
    gone = tmp_path / "no-such-state-dir"
    done = subprocess.run(
        [sys.executable, str(script), str(gone)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{gone} is already gone"
