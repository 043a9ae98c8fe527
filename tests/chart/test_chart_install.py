"""The Helm chart installed into the real control plane of tests/cluster, with the real helm.

kwok plays the kubelet, so the chart's pods are scheduled and marked Ready but never run.
The operator that the chart deploys therefore runs here as a local process, with the
chart's own arguments and a real token of the chart's operator ServiceAccount (so RBAC is
what the chart grants), and turns the example InferenceModel from values into its engine
Deployment. The Prometheus Operator's CRDs are stand-ins (any object accepted), so the
monitoring objects install too.

One release goes through its life in order: install, pods Ready, RBAC, the example
model, upgrade with changed values (twice), helm test, the CRD upgrade command, uninstall.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.chart import documents, find, helm, prepared_chart
from tests.cluster.controlplane import Cluster
from tests.support.net import free_port
from tests.support.operator_process import OperatorProcess
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RELEASE = "kvs"
NS = "kvserve-chart"
FULLNAME = "kvs-kvserve"
OPERATOR = f"{FULLNAME}-operator"
GATEWAY = f"{FULLNAME}-gateway"
USER_KEYS_SECRET = f"{GATEWAY}-keys"  # the default name of the existing Secret
GENERATED_KEYS_SECRET = "kvs-generated-keys"
TEST_KEY = "sk-kvs-chart-test-key-do-not-use"
MONITORING_KINDS = {
    "ServiceMonitor": "servicemonitors",
    "PodMonitor": "podmonitors",
    "PrometheusRule": "prometheusrules",
}

EXAMPLE_MODEL: dict[str, Any] = {
    "name": "travel-tiny",
    "spec": {
        "model": {"source": "file:///opt/kvserve/demo-model", "servedName": "kvserve-travel-tiny"},
        "replicas": 1,
        "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"},
    },
}


def install_values() -> dict[str, Any]:
    return {
        "gateway": {"replicas": 2},
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "podMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True},
        },
        "networkPolicy": {"enabled": True},
        "inferenceModels": [EXAMPLE_MODEL],
    }


def upgrade_values(gateway_replicas: int) -> dict[str, Any]:
    values = install_values()
    values["gateway"] = {
        "replicas": gateway_replicas,
        "keys": {"source": "generate", "secretName": GENERATED_KEYS_SECRET},
        "config": {"routing": {"policy": "least_load"}},
    }
    model = json.loads(json.dumps(EXAMPLE_MODEL))
    model["spec"]["replicas"] = 2
    values["inferenceModels"] = [model]
    values["dashboards"] = {"labelValue": "kvserve"}
    return values


def stub_crd(kind: str, plural: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
            },
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


@dataclass
class Release:
    cluster: Cluster
    chart: Path
    workdir: Path
    env: dict[str, str]
    install_output: str = ""
    generated_key: str | None = None
    operator: OperatorProcess | None = None

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return helm(self.cluster.bins.helm, *args, env=self.env, check=check)

    def values_file(self, name: str, values: dict[str, Any]) -> Path:
        path = self.workdir / name
        path.write_text(yaml.safe_dump(values))
        return path

    def get(self, kind: str, name: str, ns: str | None = NS) -> dict[str, Any] | None:
        args = ["get", kind, name, "-o", "json"] + (["-n", ns] if ns else [])
        proc = self.cluster.kubectl(*args, check=False)
        if proc.returncode != 0:
            assert "NotFound" in proc.stderr, proc.stderr
            return None
        return json.loads(proc.stdout)  # type: ignore[no-any-return]

    def ready(self, name: str, replicas: int) -> bool:
        d = self.get("deployment", name)
        if d is None:
            return False
        status = d.get("status") or {}
        return bool(
            d["spec"]["replicas"] == replicas
            and status.get("readyReplicas") == replicas
            and status.get("updatedReplicas") == replicas
            and status.get("observedGeneration") == d["metadata"]["generation"]
        )


@pytest.fixture(scope="module")
def release(k8s_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    workdir = tmp_path_factory.mktemp("chart-install")
    env = k8s_cluster.env()
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(workdir / var.lower())
    rel = Release(k8s_cluster, prepared_chart(workdir), workdir, env)

    stubs = [stub_crd(kind, plural) for kind, plural in MONITORING_KINDS.items()]
    k8s_cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": stubs})
    )
    for stub in stubs:
        k8s_cluster.kubectl(
            "wait",
            "--for=condition=Established",
            f"crd/{stub['metadata']['name']}",
            "--timeout=60s",
        )
    k8s_cluster.kubectl("create", "namespace", NS)
    # keys.source=existingSecret (the default): the user creates the Secret.
    keys = {
        "keys": [
            {
                "tenant": "chart-test",
                "sha256": hashlib.sha256(TEST_KEY.encode()).hexdigest(),
                "models": ["*"],
            }
        ]
    }
    (workdir / "keys.yaml").write_text(yaml.safe_dump(keys))
    k8s_cluster.kubectl(
        "create",
        "secret",
        "generic",
        USER_KEYS_SECRET,
        "-n",
        NS,
        f"--from-file=keys.yaml={workdir / 'keys.yaml'}",
    )
    proc = rel.helm(
        "install",
        RELEASE,
        str(rel.chart),
        "-n",
        NS,
        "-f",
        str(rel.values_file("install.yaml", install_values())),
    )
    rel.install_output = proc.stdout
    try:
        yield rel
    finally:
        if rel.operator is not None:
            rel.operator.stop()
            if os.environ.get("KVSERVE_SHOW_OPERATOR_LOG"):
                print(rel.operator.logs())
        rel.helm("uninstall", RELEASE, "-n", NS, "--wait", check=False)
        k8s_cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        for stub in stubs:
            k8s_cluster.kubectl(
                "delete", "crd", stub["metadata"]["name"], "--wait=false", check=False
            )


def start_operator(rel: Release) -> OperatorProcess:
    if rel.operator is None or rel.operator.proc is None:
        deployment = rel.get("deployment", OPERATOR)
        assert deployment is not None
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        assert c["command"] == ["kvserve-operator"]
        rel.operator = OperatorProcess(
            c["args"],
            rel.cluster.service_account_kubeconfig(
                NS, OPERATOR, rel.workdir / "operator.kubeconfig"
            ),
            rel.workdir / "operator.log",
            rel.cluster.env(),
        )
        rel.operator.start()
    return rel.operator


# --------------------------------------------------------------------------- the tests


def test_release_installs_and_the_crd_is_served(release: Release) -> None:
    status = json.loads(release.helm("status", RELEASE, "-n", NS, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed" and status["version"] == 1
    crd = release.get("crd", "inferencemodels.kvserve.dev", ns=None)
    assert crd is not None
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    resources = release.cluster.kubectl(
        "api-resources", "--api-group=kvserve.dev", "-o", "name"
    ).stdout
    assert "inferencemodels.kvserve.dev" in resources.split()
    # The example model from values was accepted by the CRD's schema.
    im = release.get("inferencemodel", "travel-tiny")
    assert im is not None and im["spec"]["model"]["servedName"] == "kvserve-travel-tiny"
    for kind in MONITORING_KINDS.values():
        items = json.loads(release.cluster.kubectl("get", kind, "-n", NS, "-o", "json").stdout)[
            "items"
        ]
        assert items, f"no {kind} installed"


def test_operator_and_gateway_pods_become_ready(release: Release) -> None:
    poll("the operator Deployment ready", lambda: release.ready(OPERATOR, 1), timeout=90)
    poll("the gateway Deployment ready (2 pods)", lambda: release.ready(GATEWAY, 2), timeout=90)
    pods = json.loads(
        release.cluster.kubectl(
            "get", "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "json"
        ).stdout
    )["items"]
    assert len(pods) == 3
    for pod in pods:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_notes_say_how_to_reach_the_gateway_and_create_a_model(release: Release) -> None:
    notes = release.install_output
    assert "NOTES:" in notes
    for expected in (
        f"kubectl -n {NS} port-forward service/{GATEWAY} 8080:8080",
        f"kubectl -n {NS} create secret generic {USER_KEYS_SECRET} --from-file=keys.yaml=keys.yaml",
        "kvserve gateway --new-key",
        "kind: InferenceModel",
        "kubectl apply -f -",
        "/v1/chat/completions",
        f"helm test {RELEASE} -n {NS}",
        "helm show crds",
        f"this release created {NS}/travel-tiny",
    ):
        assert expected in notes, expected
    stored = release.helm("get", "notes", RELEASE, "-n", NS).stdout
    assert f"port-forward service/{GATEWAY}" in stored


def can_i(release: Release, sa: str, *args: str) -> str:
    who = f"--as=system:serviceaccount:{NS}:{sa}"
    proc = release.cluster.kubectl("auth", "can-i", *args, who, check=False)
    return proc.stdout.strip()


def allowed(release: Release, sa: str, verb: str, group: str, resource: str) -> bool:
    """A SubjectAccessReview, cluster-wide: unlike `kubectl auth can-i`, it can name a
    resource whose CRD is not installed (the operator's leaderworkersets)."""
    base, _, sub = resource.partition("/")
    attributes = {"verb": verb, "group": group, "resource": base, "subresource": sub}
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": f"system:serviceaccount:{NS}:{sa}",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{NS}"],
            "resourceAttributes": attributes,
        },
    }
    proc = release.cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review))
    return bool(json.loads(proc.stdout)["status"].get("allowed"))


def test_service_accounts_get_exactly_their_permissions(release: Release) -> None:
    manifest = yaml.safe_load((release.chart / "files" / "operator-rbac-rules.yaml").read_text())
    # Everything the operator's manifest grants, cluster-wide (ClusterRoleBinding).
    for rule in manifest["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    granted = (verb, group, resource)
                    assert allowed(release, OPERATOR, *granted), (OPERATOR, granted)
    denied: tuple[str, ...]
    for denied in (
        ("get", "secrets", "-A"),
        ("delete", "nodes"),
        ("create", "clusterroles.rbac.authorization.k8s.io"),
        ("delete", "inferencemodels.kvserve.dev", "-A"),
        ("create", "inferencemodels.kvserve.dev", "-A"),
        ("list", "endpointslices.discovery.k8s.io", "-A"),
        ("create", "pods", "-A"),
    ):
        assert can_i(release, OPERATOR, *denied) == "no", (OPERATOR, denied)

    for granted_ in (
        ("get", "services", "-A"),
        ("list", "services", "-A"),
        ("watch", "services", "-A"),
        ("get", "endpointslices.discovery.k8s.io", "-A"),
        ("list", "endpointslices.discovery.k8s.io", "-A"),
        ("watch", "endpointslices.discovery.k8s.io", "-A"),
    ):
        assert can_i(release, GATEWAY, *granted_) == "yes", (GATEWAY, granted_)
    for denied in (
        ("get", "secrets", "-n", NS),  # its keys arrive as a mounted file, not via the API
        ("list", "pods", "-A"),
        ("create", "services", "-A"),
        ("patch", "endpointslices.discovery.k8s.io", "-A"),
        ("list", "inferencemodels.kvserve.dev", "-A"),
        ("list", "configmaps", "-n", NS),
        ("list", "endpoints", "-A"),
    ):
        assert can_i(release, GATEWAY, *denied) == "no", (GATEWAY, denied)


def test_the_example_model_gets_its_engine_deployment(release: Release) -> None:
    start_operator(release)

    def engine() -> dict[str, Any] | None:
        return release.get("deployment", "travel-tiny")

    deployment = poll("the example model's engine Deployment", engine, timeout=90)
    assert deployment is not None
    im = release.get("inferencemodel", "travel-tiny")
    assert im is not None
    owner = deployment["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"]) == ("InferenceModel", im["metadata"]["uid"])
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    # The chart's --engine-image, the same image the gateway runs.
    gateway = release.get("deployment", GATEWAY)
    assert gateway is not None
    assert c["image"] == gateway["spec"]["template"]["spec"]["containers"][0]["image"]
    assert release.get("service", "travel-tiny") is not None

    def ready() -> bool:
        im = release.get("inferencemodel", "travel-tiny") or {}
        conditions = {
            c["type"]: c["status"] for c in (im.get("status") or {}).get("conditions", [])
        }
        return conditions.get("Ready") == "True"

    poll("the example model Ready", ready, timeout=90)


def test_the_gateway_finds_the_model_as_its_service_account(release: Release) -> None:
    """The chart's gateway config, keys and ServiceAccount, with the gateway as a local
    process: it discovers the example model's engine from its EndpointSlice, and the
    `helm test` job's script, run against it, passes."""
    start_operator(release)
    poll("the example model's engine ready", lambda: release.ready("travel-tiny", 1), timeout=90)
    configmap = release.get("configmap", GATEWAY)
    secret = release.get("secret", USER_KEYS_SECRET)
    assert configmap is not None and secret is not None
    workdir = release.workdir / "gateway"
    workdir.mkdir(exist_ok=True)
    (workdir / "keys.yaml").write_bytes(base64.b64decode(secret["data"]["keys.yaml"]))
    config = yaml.safe_load(configmap["data"]["gateway.yaml"])
    assert config["keys_file"] == "/etc/kvserve/keys/keys.yaml"
    assert config["listen"]["host"] == "0.0.0.0"
    port = free_port()
    config["listen"] = {"host": "127.0.0.1", "port": port}  # loopback instead of the pod's
    config["keys_file"] = str(workdir / "keys.yaml")
    (workdir / "gateway.yaml").write_text(yaml.safe_dump(config))
    env = release.cluster.env()
    env["KUBECONFIG"] = str(
        release.cluster.service_account_kubeconfig(NS, GATEWAY, workdir / "kubeconfig")
    )
    log_path = workdir / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-c", "import sys; from kvserve.cli import main; sys.exit(main())",
                "gateway", "--config", str(workdir / "gateway.yaml"),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def discovered() -> list[str] | None:
            if proc.poll() is not None:
                raise AssertionError(f"gateway exited: {log_path.read_text()[-3000:]}")
            try:
                r = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {TEST_KEY}"})
            except httpx.TransportError:
                return None
            ids = [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []
            return ids if "kvserve-travel-tiny" in ids else None

        assert poll("the gateway to discover the example model", discovered, timeout=90) == [
            "kvserve-travel-tiny"
        ]
        hooks = documents(release.helm("get", "hooks", RELEASE, "-n", NS).stdout)
        (c,) = find(hooks, "Job", f"{FULLNAME}-test")["spec"]["template"]["spec"]["containers"]
        assert c["command"][:2] == ["python", "-c"]
        for key, expected in (("", "401 without a key"), (TEST_KEY, "'kvserve-travel-tiny'")):
            test_env = {"GATEWAY_URL": url} | ({"KVSERVE_API_KEY": key} if key else {})
            job = subprocess.run(
                [sys.executable, "-c", c["command"][2]],
                env=test_env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert job.returncode == 0 and expected in job.stdout, job.stdout + job.stderr
        assert "forbidden" not in log_path.read_text().lower(), log_path.read_text()[-3000:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_upgrade_with_changed_values(release: Release) -> None:
    start_operator(release)
    values = release.values_file("upgrade.yaml", upgrade_values(gateway_replicas=3))
    release.helm("upgrade", RELEASE, str(release.chart), "-n", NS, "-f", str(values))
    status = json.loads(release.helm("status", RELEASE, "-n", NS, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed" and status["version"] == 2

    poll("the gateway at 3 ready pods", lambda: release.ready(GATEWAY, 3), timeout=90)
    gateway = release.get("deployment", GATEWAY)
    assert gateway is not None
    pod = gateway["spec"]["template"]["spec"]
    keys = next(v for v in pod["volumes"] if v["name"] == "keys")
    assert keys["secret"]["secretName"] == GENERATED_KEYS_SECRET
    config = release.get("configmap", GATEWAY)
    assert config is not None and "policy: least_load" in config["data"]["gateway.yaml"]
    # The operator rolls the new replica count of the example model out.
    poll(
        "the example model at 2 engine replicas",
        lambda: release.ready("travel-tiny", 2),
        timeout=90,
    )

    secret = release.get("secret", GENERATED_KEYS_SECRET)
    assert secret is not None
    key = base64.b64decode(secret["data"]["api-key"]).decode()
    keys_file = yaml.safe_load(base64.b64decode(secret["data"]["keys.yaml"]))
    assert keys_file["keys"][0]["sha256"] == hashlib.sha256(key.encode()).hexdigest()
    release.generated_key = key

    # Another upgrade keeps the generated key (the chart looks the Secret up).
    values = release.values_file("upgrade2.yaml", upgrade_values(gateway_replicas=2))
    release.helm("upgrade", RELEASE, str(release.chart), "-n", NS, "-f", str(values))
    poll("the gateway back at 2 ready pods", lambda: release.ready(GATEWAY, 2), timeout=90)
    secret = release.get("secret", GENERATED_KEYS_SECRET)
    assert secret is not None
    assert base64.b64decode(secret["data"]["api-key"]).decode() == key
    dashboards = json.loads(
        release.cluster.kubectl(
            "get", "configmaps", "-n", NS, "-l", "grafana_dashboard=kvserve", "-o", "json"
        ).stdout
    )["items"]
    assert dashboards, "the dashboards' label value follows the values"


def test_helm_test_calls_the_gateway(release: Release) -> None:
    # kwok completes a Job's pod without running it, so this shows the hook is wired up
    # (rendered, created, awaited, cleaned up), not that the gateway answered.
    proc = release.helm("test", RELEASE, "-n", NS, "--timeout", "120s", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Phase:          Succeeded" in proc.stdout or "Succeeded" in proc.stdout, proc.stdout
    # hook-succeeded: the Job is gone again.
    poll("the test Job deleted", lambda: release.get("job", f"{FULLNAME}-test") is None, timeout=60)


def test_crd_upgrade_command_of_the_readme_works(release: Release) -> None:
    crds = release.helm("show", "crds", str(release.chart)).stdout
    proc = release.cluster.kubectl("apply", "--server-side", "-f", "-", input=crds, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "inferencemodels.kvserve.dev" in proc.stdout


def test_uninstall_keeps_the_crd_and_removes_the_rest(release: Release) -> None:
    # The pre-delete hook deletes the example models while the operator still runs (it
    # must release its finalizer). kwok would complete the hook's pod without running
    # it, so its script runs here, as the hook's ServiceAccount, before `helm uninstall`.
    operator = start_operator(release)
    cleanup = f"{FULLNAME}-cleanup"
    hooks = documents(release.helm("get", "hooks", RELEASE, "-n", NS).stdout)
    job = find(hooks, "Job", cleanup)
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["python", "-c"]
    env = dict(release.cluster.env())
    env.update({e["name"]: e["value"] for e in c["env"]})
    env["KUBECONFIG"] = str(
        release.cluster.service_account_kubeconfig(
            NS, cleanup, release.workdir / "cleanup.kubeconfig"
        )
    )
    assert (
        can_i(release, cleanup, "delete", "inferencemodels.kvserve.dev/travel-tiny", "-n", NS)
        == "yes"
    )
    assert can_i(release, cleanup, "delete", "inferencemodels.kvserve.dev/other", "-n", NS) == "no"
    assert can_i(release, cleanup, "list", "inferencemodels.kvserve.dev", "-n", NS) == "no"
    proc = subprocess.run(
        [sys.executable, *c["command"][1:]], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr + operator.logs()[-3000:]
    assert release.get("inferencemodel", "travel-tiny") is None
    poll(
        "the engine Deployment collected",
        lambda: release.get("deployment", "travel-tiny") is None,
        timeout=90,
    )
    operator.stop()  # its ServiceAccount goes with the release

    release.helm("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "120s")

    assert release.get("crd", "inferencemodels.kvserve.dev", ns=None) is not None, (
        "the CRD must stay (deleting it would delete every InferenceModel)"
    )
    selector = f"app.kubernetes.io/instance={RELEASE}"
    namespaced = (
        "deployments,services,configmaps,secrets,serviceaccounts,networkpolicies,"
        "poddisruptionbudgets,jobs,inferencemodels,roles,rolebindings,"
        + ",".join(MONITORING_KINDS.values())
    )

    def leftovers() -> list[str]:
        out = release.cluster.kubectl(
            "get", namespaced, "-n", NS, "-l", selector, "-o", "name"
        ).stdout
        out += release.cluster.kubectl(
            "get", "clusterroles,clusterrolebindings", "-l", selector, "-o", "name"
        ).stdout
        return out.split()

    poll("nothing of the release left", lambda: not leftovers(), timeout=60)
    # The Secret the user created is the user's.
    assert release.get("secret", USER_KEYS_SECRET) is not None
    assert release.helm("status", RELEASE, "-n", NS, check=False).returncode != 0
