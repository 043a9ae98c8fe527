"""The operator image (docker/operator.Dockerfile) against the real control plane of
tests/cluster: it starts with the chart's pod security, serves /healthz, reaches the API
server with a ServiceAccount's kubeconfig, and its reconcile of an InferenceModel
renders the engine Deployment (with the engine image it was given)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster.controlplane import Cluster
from tests.images.containers import POD_SECURITY, running
from tests.support.net import free_port
from tests.support.operator_process import OPERATOR_NS, OPERATOR_SA, install_operator_rbac
from tests.support.waiting import poll

pytestmark = [pytest.mark.images, pytest.mark.cluster, pytest.mark.slow]

NS = "kvserve-images"
DEMO_SOURCE = "file:///opt/kvserve/demo-model"


def deployment(cluster: Cluster, name: str) -> dict[str, Any] | None:
    proc = cluster.kubectl("get", "deployment", name, "-n", NS, "-o", "json", check=False)
    if proc.returncode != 0:
        assert "NotFound" in proc.stderr, proc.stderr
        return None
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_operator_image_reconciles_an_inference_model(
    k8s_cluster: Cluster, operator_image: str, engine_image: str, tmp_path: Path
) -> None:
    install_operator_rbac(k8s_cluster)
    kubeconfig = k8s_cluster.service_account_kubeconfig(
        OPERATOR_NS, OPERATOR_SA, tmp_path / "kubeconfig"
    )
    kubeconfig.chmod(0o644)  # read by the container's uid 1000
    health, metrics = free_port(), free_port()
    # The chart's arguments (operator-deployment.yaml), on loopback ports of the host.
    args = [
        "--engine-image", engine_image, "--image-pull-policy", "IfNotPresent",
        "--log-format", "json", "--metrics-port", str(metrics), "--health-port", str(health),
        "--bind", "127.0.0.1", "--reconcile-interval", "3", "--namespace", NS,
    ]  # fmt: skip
    options = [
        *POD_SECURITY,
        "-v", f"{kubeconfig}:/etc/kvserve/kubeconfig:ro",
        "-e", "KUBECONFIG=/etc/kvserve/kubeconfig",
        "-e", "HOME=/tmp",
    ]  # fmt: skip
    k8s_cluster.kubectl("create", "namespace", NS)
    try:
        with running(operator_image, args, name="operator", options=options) as container:

            def healthy() -> bool:
                container.alive()
                try:
                    url = f"http://127.0.0.1:{health}/healthz"
                    return httpx.get(url, timeout=5).status_code == 200
                except httpx.TransportError:
                    return False

            poll("the operator container's /healthz", healthy, timeout=120)
            im = {
                "apiVersion": "kvserve.dev/v1alpha1",
                "kind": "InferenceModel",
                "metadata": {"name": "demo", "namespace": NS},
                "spec": {"model": {"source": DEMO_SOURCE, "servedName": "kvserve-travel-tiny"}},
            }
            k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(im))

            def rendered() -> dict[str, Any] | None:
                container.alive()
                return deployment(k8s_cluster, "demo")

            dep = poll("the Deployment of InferenceModel demo", rendered, timeout=120)
            pod = dep["spec"]["template"]["spec"]
            (engine,) = pod["containers"]
            (init,) = pod["initContainers"]
            assert engine["image"] == init["image"] == engine_image
            assert engine["command"] == ["kvserve", "serve"]
            assert init["command"][:3] == ["kvserve", "model", "pull"]
            assert DEMO_SOURCE in init["command"]
            assert httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).status_code == 200
    finally:
        k8s_cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
