"""The pod runner itself (tests/cluster/pod_runner.py): a pod's volumes, environment,
readiness and deletion, with a small real process (``kvserve gateway`` with a static
replica list), and a pod it cannot run."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.cluster.controlplane import Cluster
from tests.cluster.pod_runner import PodRunner, scheduling
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "pod-runner"
KEY = "sk-pod-runner-test-key-do-not-use"
# The gateway binds 0.0.0.0 and its replica is on 127.0.0.1, as inside a pod: the runner
# makes both the pod's IP.
GATEWAY_CONFIG = {
    "listen": {"host": "0.0.0.0", "port": 8080},
    "keys_file": "/etc/gw/keys/keys.yaml",
    "models": {"m": {"replicas": ["grpc://127.0.0.1:50051"]}},
}


def get_pod(cluster: Cluster, name: str) -> dict[str, Any] | None:
    proc = cluster.kubectl("get", "pod", name, "-n", NS, "-o", "json", check=False)
    if proc.returncode != 0:
        assert "NotFound" in proc.stderr, proc.stderr
        return None
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def condition(pod: dict[str, Any] | None, kind: str) -> str | None:
    for c in ((pod or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return str(c["status"])
    return None


def gateway_pod(name: str, command: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            **scheduling(),
            "terminationGracePeriodSeconds": 30,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "gateway",
                    "image": "example.invalid/kvserve:test",
                    "command": command,
                    "ports": [{"name": "http", "containerPort": 8080}],
                    "env": [
                        {"name": "HOME", "value": "/tmp"},
                        {
                            "name": "KVSERVE_CACHE_SALT_SECRET",
                            "valueFrom": {"secretKeyRef": {"name": "salt", "key": "secret"}},
                        },
                        {
                            "name": "MY_POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        },
                    ],
                    "readinessProbe": {
                        "httpGet": {"path": "/health", "port": "http"},
                        "periodSeconds": 5,
                    },
                    "lifecycle": {"preStop": {"sleep": {"seconds": 1}}},
                    "volumeMounts": [
                        {
                            "name": "config",
                            "mountPath": "/etc/gw/gateway.yaml",
                            "subPath": "gateway.yaml",
                        },
                        {"name": "keys", "mountPath": "/etc/gw/keys", "readOnly": True},
                        {"name": "tmp", "mountPath": "/tmp"},
                    ],
                }
            ],
            "volumes": [
                {"name": "config", "configMap": {"name": "gw"}},
                {"name": "keys", "secret": {"secretName": "keys"}},
                {"name": "tmp", "emptyDir": {}},
            ],
        },
    }


def ready_pod(cluster: Cluster, name: str) -> dict[str, Any] | None:
    pod = get_pod(cluster, name)
    phase = ((pod or {}).get("status") or {}).get("phase")
    assert phase != "Failed", pod and pod["status"]
    return pod if condition(pod, "Ready") == "True" else None


def apply(cluster: Cluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))


def test_a_pod_runs_with_its_volumes_env_and_probe_and_stops_when_deleted(
    k8s_cluster: Cluster, pod_runner: PodRunner
) -> None:
    k8s_cluster.kubectl("create", "namespace", NS)
    apply(
        k8s_cluster, gateway_pod("gw", ["kvserve", "gateway", "--config", "/etc/gw/gateway.yaml"])
    )
    # The pod waits for what it mounts and reads, as it would for a kubelet.
    poll(
        "the runner waiting for the pod's ConfigMap",
        lambda: any("gw waits" in line for line in pod_runner.log),
        timeout=30,
    )
    assert condition(get_pod(k8s_cluster, "gw"), "Ready") != "True"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    keys = {"keys": [{"tenant": "t", "sha256": digest, "models": ["*"]}]}
    for obj in (
        {"kind": "ConfigMap", "metadata": {"name": "gw"},
         "data": {"gateway.yaml": yaml.safe_dump(GATEWAY_CONFIG)}},
        {"kind": "Secret", "metadata": {"name": "keys"},
         "data": {"keys.yaml": base64.b64encode(yaml.safe_dump(keys).encode()).decode()}},
        {"kind": "Secret", "metadata": {"name": "salt"},
         "data": {"secret": base64.b64encode(b"0123456789abcdef0123").decode()}},
    ):  # fmt: skip
        obj["metadata"] = {**obj["metadata"], "namespace": NS}  # type: ignore[dict-item]
        apply(k8s_cluster, {"apiVersion": "v1", **obj})

    try:
        pod = poll("the pod Ready", lambda: ready_pod(k8s_cluster, "gw"), 120)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n" + "\n".join(pod_runner.log[-30:])) from None
    assert pod
    ip = pod["status"]["podIP"]
    assert pod_runner.network is not None and ipaddress.ip_address(ip) in pod_runner.network
    assert pod["status"]["phase"] == "Running"
    (status,) = pod["status"]["containerStatuses"]
    assert status["ready"] is True and "running" in status["state"]

    # Served on the pod IP, with the mounted keys; the static replica became the pod's IP.
    assert httpx.get(f"http://{ip}:8080/health").status_code == 200
    models = httpx.get(f"http://{ip}:8080/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert [m["id"] for m in models.json()["data"]] == ["m"]
    (running,) = pod_runner.find(NS, "gw")
    proc = running.main[0].proc
    assert proc is not None
    environ = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{proc.pid}/environ").read_text().split("\0")
        if "=" in item
    )
    assert environ["MY_POD_IP"] == ip
    assert environ["KVSERVE_CACHE_SALT_SECRET"] == "0123456789abcdef0123"
    assert Path(environ["HOME"]).is_dir() and Path(environ["HOME"]).name == "tmp"
    served = (Path(environ["HOME"]).parent / "config" / "gateway.yaml").read_text()
    assert f"grpc://{ip}:50051" in served and "/etc/gw/keys" not in served

    # Deletion: preStop, SIGTERM (the gateway shuts down; uvicorn then re-raises the
    # signal, so a runtime reports 143, and 0 with older uvicorns), then the runner
    # removes the pod. Not SIGKILL (137): the grace period is 30 s.
    k8s_cluster.kubectl("delete", "pod", "gw", "-n", NS, "--wait=false")
    poll("the pod removed by the runner", lambda: get_pod(k8s_cluster, "gw") is None, 60)
    assert running.main[0].exit_code in (0, 128 + 15), proc.tail()
    assert "Finished server process" in proc.tail()


def test_a_pod_with_an_unknown_command_fails_with_a_message(
    k8s_cluster: Cluster, pod_runner: PodRunner
) -> None:
    k8s_cluster.kubectl("create", "namespace", NS, check=False)
    bad = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "bad", "namespace": NS},
        "spec": {
            **scheduling(),
            "containers": [{"name": "web", "image": "nginx", "command": ["nginx"]}],
        },
    }
    apply(k8s_cluster, bad)
    pod = poll(
        "the pod Failed",
        lambda: (p := get_pod(k8s_cluster, "bad")) and p["status"].get("phase") == "Failed" and p,
        60,
    )
    assert pod and "no known entry point" in pod["status"].get("message", ""), pod
    k8s_cluster.kubectl("delete", "namespace", NS, "--wait=false")
