"""The Helm chart without a cluster: helm lint and helm template (the real helm binary of
tests/cluster) over every values file in charts/kvserve/ci/, each rendered object
validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict), the
InferenceModels by the operator's own spec parser, the gateway's config and keys by the
gateway's loaders; values typos refused by values.schema.json with a message naming
them; the operator's RBAC rules and the CRD equal to the operator's manifests.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.chart import (
    CHART,
    CI_VALUES,
    KUBE_VERSION,
    REPO,
    documents,
    find,
    helm,
    helm_binary,
    pod_specs,
    prepared_chart,
    template_args,
    values_args,
)

HELM = helm_binary()
if HELM is None:
    pytest.skip(
        "helm is not built (tests/cluster/build.py builds it; needs Go)", allow_module_level=True
    )

MANIFESTS = REPO / "operator" / "kvserve_operator" / "manifests"
VALUES_NAMES = [p.name for p in CI_VALUES]
RELEASE, NAMESPACE = "kvs", "kvserve-system"
OPERATOR, GATEWAY = "kvs-kvserve-operator", "kvs-kvserve-gateway"


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepared_chart(tmp_path_factory.mktemp("chart"))


def render(chart: Path, *values: str, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    files = [chart / "ci" / v for v in values]
    assert HELM is not None
    return documents(helm(HELM, *template_args(chart, files, sets)).stdout)


def render_error(chart: Path, *sets: str, values: tuple[str, ...] = ()) -> str:
    assert HELM is not None
    files = [chart / "ci" / v for v in values]
    proc = helm(HELM, *template_args(chart, files, sets), check=False)
    assert proc.returncode != 0, f"--set {sets} rendered without an error"
    return proc.stderr


@pytest.fixture(scope="module")
def rendered(chart: Path) -> dict[str, list[dict[str, Any]]]:
    return {name: render(chart, name) for name in VALUES_NAMES}


# ------------------------------------------------------------------ lint and validation


@pytest.mark.parametrize("values", VALUES_NAMES)
def test_helm_lint_strict(chart: Path, values: str) -> None:
    assert HELM is not None
    proc = helm(
        HELM,
        "lint",
        "--strict",
        str(chart),
        "--kube-version",
        KUBE_VERSION,
        *values_args([chart / "ci" / values]),
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # Lint logs a template's `fail` as INFO and goes on; any of them is a failure here.
    for bad in ("[WARNING]", "[ERROR]", "Fail:"):
        assert bad not in out, out


def validate_monitoring(obj: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    """monitoring.coreos.com objects: no OpenAPI schema here (their CRDs are not part of
    Kubernetes), so their structure is checked against what they point at."""
    from kvserve_operator.render import child_labels

    spec = obj["spec"]
    duration = re.compile(r"^([0-9]+(ms|s|m|h))+$")
    if obj["kind"] == "ServiceMonitor":
        selector = spec["selector"]["matchLabels"]
        services = [
            o
            for o in objects
            if o["kind"] == "Service"
            and selector.items() <= o["metadata"]["labels"].items()
            and o["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
        ]
        assert len(services) == 1, f"{obj['metadata']['name']} selects {len(services)} Services"
        port_names = {p["name"] for p in services[0]["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert endpoint["port"] in port_names
            assert endpoint["path"] == "/metrics"
            assert duration.match(endpoint["interval"]) and duration.match(
                endpoint["scrapeTimeout"]
            )
    elif obj["kind"] == "PodMonitor":
        # It must select the engine pods exactly as the operator labels them.
        assert spec["selector"]["matchLabels"].items() <= child_labels("any-model").items()
        assert set(spec["namespaceSelector"]) <= {"any", "matchNames"}
        for endpoint in spec["podMetricsEndpoints"]:
            assert endpoint["port"] == "http"  # the engine container's HTTP port (render.py)
            assert endpoint["path"] == "/metrics"
            assert duration.match(endpoint["interval"])
    elif obj["kind"] == "PrometheusRule":
        assert spec["groups"], "no rule groups"
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert ("alert" in rule) != ("record" in rule), rule
                assert isinstance(rule["expr"], str | int) and str(rule["expr"]).strip()
    else:
        raise AssertionError(f"unexpected monitoring kind {obj['kind']}")


def validate(obj: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    from kvserve_operator.render import check_name
    from kvserve_operator.spec import parse_spec

    where = f"{obj['kind']}/{obj['metadata']['name']}"
    if obj["apiVersion"] == "monitoring.coreos.com/v1":
        validate_monitoring(obj, objects)
    elif obj["apiVersion"] == "kvserve.dev/v1alpha1":
        check_name(obj["metadata"]["name"])
        parse_spec(obj["spec"])  # the operator's parser: same rules and defaults as the CRD
    else:
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {exc.message} at {list(exc.path)}") from None


@pytest.mark.parametrize("values", VALUES_NAMES)
def test_every_rendered_object_is_valid(
    rendered: dict[str, list[dict[str, Any]]], values: str
) -> None:
    objects = rendered[values]
    assert objects
    names = set()
    for obj in objects:
        validate(obj, objects)
        key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        assert key not in names, f"{key} rendered twice"
        names.add(key)
        if obj["kind"] != "CustomResourceDefinition":
            labels = obj["metadata"]["labels"]
            assert labels["app.kubernetes.io/instance"] == RELEASE
            assert labels["app.kubernetes.io/managed-by"] == "Helm"


@pytest.mark.parametrize("values", VALUES_NAMES)
def test_pods_have_secure_defaults(rendered: dict[str, list[dict[str, Any]]], values: str) -> None:
    specs = pod_specs(rendered[values])
    assert specs
    for where, spec in specs.items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True, where
        assert pod["runAsUser"] == 1000 and pod["runAsGroup"] == 1000, where
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), where
        tmp = next(v for v in spec["volumes"] if v["name"] == "tmp")
        assert "emptyDir" in tmp, where
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["privileged"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in sc["capabilities"], where
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
            assert "memory" in c["resources"]["limits"], where
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], where
            assert not c["image"].endswith(":latest"), where


# ------------------------------------------------------------------- what gets rendered


def kinds(objects: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objects}


def test_defaults_render_the_operator_gateway_and_crd(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["default-values.yaml"]
    expected = {
        ("CustomResourceDefinition", "inferencemodels.kvserve.dev"),
        ("ServiceAccount", OPERATOR),
        ("ClusterRole", OPERATOR),
        ("ClusterRoleBinding", OPERATOR),
        ("Deployment", OPERATOR),
        ("Service", OPERATOR),
        ("ServiceAccount", GATEWAY),
        ("ClusterRole", GATEWAY),
        ("ClusterRoleBinding", GATEWAY),
        ("ConfigMap", GATEWAY),
        ("Deployment", GATEWAY),
        ("Service", GATEWAY),
        ("PodDisruptionBudget", GATEWAY),
        ("Secret", f"{GATEWAY}-cache-salt"),
        ("Job", "kvs-kvserve-test"),
    }
    dashboards = {("ConfigMap", n) for k, n in kinds(objects) if n.startswith("kvs-kvserve-dash")}
    assert dashboards, "the dashboards are on by default"
    assert kinds(objects) == expected | dashboards
    # No keys Secret by default: the keys come from a Secret the user creates.
    volume = next(
        v
        for v in find(objects, "Deployment", GATEWAY)["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "keys"
    )
    assert volume["secret"]["secretName"] == "kvs-kvserve-gateway-keys"


def test_the_cache_salt_secret_is_generated_or_taken_from_an_existing_secret(
    chart: Path, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    def salt_env(objects: list[dict[str, Any]]) -> dict[str, Any]:
        container = find(objects, "Deployment", GATEWAY)["spec"]["template"]["spec"]
        env = {e["name"]: e for e in container["containers"][0]["env"]}
        return env["KVSERVE_CACHE_SALT_SECRET"]["valueFrom"]["secretKeyRef"]  # type: ignore[no-any-return]

    objects = rendered["default-values.yaml"]
    generated = find(objects, "Secret", f"{GATEWAY}-cache-salt")
    assert len(base64.b64decode(generated["data"]["secret"])) >= 16
    assert salt_env(objects) == {"name": f"{GATEWAY}-cache-salt", "key": "secret"}
    sets = ("gateway.cacheSaltSecret.name=my-salt", "gateway.cacheSaltSecret.key=s")
    own = render(chart, "default-values.yaml", sets=sets)
    assert salt_env(own) == {"name": "my-salt", "key": "s"}
    assert not [n for k, n in kinds(own) if k == "Secret"]


def test_minimal_renders_only_the_operator(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert {k for k, _ in kinds(rendered["minimal-values.yaml"])} == {
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Service",
    }
    assert all("gateway" not in n for _, n in kinds(rendered["minimal-values.yaml"]))


def test_all_features_render_every_optional_object(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["all-features-values.yaml"]
    present = {k for k, _ in kinds(objects)}
    assert {
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
        "ServiceMonitor",
        "PodMonitor",
        "PrometheusRule",
        "InferenceModel",
        "Secret",
        "PodDisruptionBudget",
    } <= present
    deployment = find(objects, "Deployment", GATEWAY)
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    hpa = find(objects, "HorizontalPodAutoscaler", GATEWAY)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert hpa["spec"]["scaleTargetRef"]["name"] == GATEWAY
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        for obj in objects:
            if obj["kind"] == kind:
                assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    models = {o["metadata"]["name"]: o for o in objects if o["kind"] == "InferenceModel"}
    assert models["travel-tiny"]["metadata"]["namespace"] == NAMESPACE
    assert models["llama-8b"]["metadata"]["namespace"] == "models"
    assert models["llama-8b"]["metadata"]["labels"]["example.com/tier"] == "gold"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry-pull"}]
    assert pod["containers"][0]["image"] == (
        "registry.example.com/kvserve/kvserve:0.1.0@sha256:" + "0123456789abcdef" * 4
    )


def test_network_policies(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["all-features-values.yaml"]
    gateway = find(objects, "NetworkPolicy", GATEWAY)["spec"]
    assert gateway["policyTypes"] == ["Ingress", "Egress"]
    ingress, metrics = gateway["ingress"]  # gateway.metricsPort is set there
    assert ingress["ports"] == [{"port": "http", "protocol": "TCP"}]
    test_peer = {"app.kubernetes.io/component": "test", "app.kubernetes.io/instance": RELEASE}
    assert any(
        test_peer.items() <= p.get("podSelector", {}).get("matchLabels", {}).items()
        for p in ingress["from"]
    ), "the helm test job must be allowed in"
    # Prometheus (metricsFrom) and the operator (held requests: scale from zero) to the
    # metrics port; the API's peers only to the API.
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    operator_peer = {
        "app.kubernetes.io/component": "operator",
        "app.kubernetes.io/instance": RELEASE,
    }
    assert [p.get("namespaceSelector", {}).get("matchLabels") for p in metrics["from"]] == [
        monitoring,
        None,
    ]
    assert operator_peer.items() <= metrics["from"][1]["podSelector"]["matchLabels"].items()
    egress_ports = [p["port"] for rule in gateway["egress"] for p in rule["ports"]]
    assert egress_ports == [53, 53, 443, 6443, "grpc"]
    cidrs = [
        t["ipBlock"]["cidr"] for r in gateway["egress"] for t in r.get("to", []) if "ipBlock" in t
    ]
    assert cidrs == ["10.0.0.1/32", "172.18.0.2/32"]
    operator = find(objects, "NetworkPolicy", OPERATOR)["spec"]
    assert [r["ports"][0]["port"] for r in operator["ingress"]] == ["metrics", "health"]
    # The engines' HTTP port (queue metrics), the gateway's metrics port (held requests).
    assert [r["ports"] for r in operator["egress"][-2:]] == [
        [{"port": "http", "protocol": "TCP"}],
        [{"port": "metrics", "protocol": "TCP"}],
    ]


# ------------------------------------------------------------------------- the operator


def container(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    containers = find(objects, kind, name)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("values", [v for v in VALUES_NAMES if v != "minimal-values.yaml"])
def test_operator_command_is_the_operators_cli(
    rendered: dict[str, list[dict[str, Any]]], values: str
) -> None:
    from kvserve_operator.__main__ import build_parser

    objects = rendered[values]
    deployment = find(objects, "Deployment", OPERATOR)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    c = container(objects, "Deployment", OPERATOR)
    assert c["command"] == ["kvserve-operator"]
    args = build_parser().parse_args(c["args"])  # exits (fails the test) on a bad flag
    assert args.log_format == "json"
    assert (args.metrics_port, args.health_port) == (8081, 8080)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"health": 8080, "metrics": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    values_doc = yaml.safe_load((CHART / "ci" / values).read_text()) or {}
    namespaces = (values_doc.get("operator") or {}).get("watchNamespaces", [])
    assert args.namespace == namespaces
    # Scale from zero: the gateway pods it reads held requests from, and where.
    gateways = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == GATEWAY
    ]
    if not gateways:
        assert args.gateway_selector is None
        return
    template = gateways[0]["spec"]["template"]
    labels = template["metadata"]["labels"]
    wanted = dict(pair.split("=") for pair in args.gateway_selector.split(","))
    assert wanted.items() <= labels.items() and "app.kubernetes.io/component" in wanted
    assert args.gateway_namespace == NAMESPACE
    port = template["metadata"]["annotations"]["prometheus.io/port"]
    assert args.gateway_metrics_url_template == f"http://{{pod_ip}}:{port}/metrics"
    # Its RBAC lets it list pods there: a Role when the watched namespaces leave it out.
    role = [
        o
        for o in objects
        if o["kind"] == "Role" and o["metadata"]["name"].endswith("-gateway-pods")
    ]
    if namespaces and NAMESPACE not in namespaces:
        assert role and role[0]["metadata"]["namespace"] == NAMESPACE
        assert role[0]["rules"] == [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}
        ]
    else:
        assert not role


def test_default_images_match_the_operator_and_the_project(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    import tomllib

    from kvserve_operator.render import OperatorSettings

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart_meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart_meta["appVersion"] == version
    assert chart_meta["kubeVersion"]
    objects = rendered["default-values.yaml"]
    c = container(objects, "Deployment", OPERATOR)
    assert c["image"] == f"ghcr.io/kvserve/kvserve-operator:{version}"
    engine_image = c["args"][c["args"].index("--engine-image") + 1]
    assert engine_image == f"ghcr.io/kvserve/kvserve:{version}"
    assert engine_image == OperatorSettings().engine_image, "keep the operator's default in step"
    assert container(objects, "Deployment", GATEWAY)["image"] == engine_image


def test_operator_rbac_rules_are_the_operators_manifest(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    copy = CHART / "files" / "operator-rbac-rules.yaml"
    manifest = MANIFESTS / "rbac.yaml"
    assert copy.read_bytes() == manifest.read_bytes(), (
        f"the chart's copy is stale: cp {manifest.relative_to(REPO)} {copy.relative_to(REPO)}"
    )
    rules = yaml.safe_load(manifest.read_text())["rules"]
    for values in VALUES_NAMES:
        assert find(rendered[values], "ClusterRole", OPERATOR)["rules"] == rules, values


def test_crd_is_the_operators_manifest(rendered: dict[str, list[dict[str, Any]]]) -> None:
    # The copy is generated (tests/operator/test_crd_generated.py checks it is current).
    copy = CHART / "crds" / "inferencemodels.kvserve.dev.yaml"
    manifest = MANIFESTS / "crd.yaml"
    assert yaml.safe_load(copy.read_text()) == yaml.safe_load(manifest.read_text()), (
        "the chart's CRD is stale: python -m kvserve_operator.crd"
    )
    assert list((CHART / "crds").iterdir()) == [copy]
    crd = find(rendered["default-values.yaml"], "CustomResourceDefinition")
    assert crd == yaml.safe_load(manifest.read_text())


def test_namespaced_mode_binds_roles_per_namespace(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["namespaced-values.yaml"]
    rules = yaml.safe_load((MANIFESTS / "rbac.yaml").read_text())["rules"]
    bindings = [
        o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["name"] == OPERATOR
    ]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": OPERATOR,
        }
    cluster_bindings = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
    assert [b["metadata"]["name"] for b in cluster_bindings] == [f"{OPERATOR}-cluster"]
    cluster_rules = find(objects, "ClusterRole", f"{OPERATOR}-cluster")["rules"]
    assert cluster_rules == [
        r for r in rules if {"customresourcedefinitions", "namespaces"} & set(r["resources"])
    ]
    for r in cluster_rules:
        assert set(r["verbs"]) <= {"get", "list", "watch"}
    # The gateway: a Role per namespace, no cluster-wide read.
    roles = [o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == GATEWAY]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert not [
        o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] == GATEWAY
    ]
    config = yaml.safe_load(find(objects, "ConfigMap", GATEWAY)["data"]["gateway.yaml"])
    assert config["discovery"]["kubernetes"]["namespaces"] == ["team-a", "team-b"]
    podmonitor = find(objects, "PodMonitor")
    assert podmonitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


DISCOVERY_RULES = [
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    },
]


def test_gateway_rbac_is_exactly_discovery(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["default-values.yaml"]
    assert find(objects, "ClusterRole", GATEWAY)["rules"] == DISCOVERY_RULES
    binding = find(objects, "ClusterRoleBinding", GATEWAY)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": GATEWAY, "namespace": NAMESPACE}
    ]
    for role in (
        o
        for o in rendered["namespaced-values.yaml"]
        if o["kind"] == "Role" and o["metadata"]["name"] == GATEWAY
    ):
        assert role["rules"] == DISCOVERY_RULES
    pod = find(objects, "Deployment", GATEWAY)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == GATEWAY and pod["automountServiceAccountToken"] is True


def test_static_mode_has_no_gateway_rbac_and_no_token(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["static-values.yaml"]
    assert not [o for o in objects if o["kind"] in ("Role", "RoleBinding")]
    assert {n for k, n in kinds(objects) if k.startswith("ClusterRole")} == {OPERATOR}
    pod = find(objects, "Deployment", GATEWAY)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    keys = next(v for v in pod["volumes"] if v["name"] == "keys")["secret"]
    assert keys["secretName"] == "my-gateway-keys"
    assert keys["items"] == [{"key": "gateway-keys.yaml", "path": "keys.yaml"}]
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"
    service = find(objects, "Service", GATEWAY)["spec"]
    assert service["type"] == "NodePort" and service["ports"][0]["nodePort"] == 30080
    job = find(objects, "Job")["spec"]["template"]["spec"]["containers"][0]
    key_env = next(e for e in job["env"] if e["name"] == "KVSERVE_API_KEY")
    assert key_env["valueFrom"]["secretKeyRef"] == {"name": "gateway-test-key", "key": "api-key"}


# -------------------------------------------------------------------------- the gateway


@pytest.mark.parametrize("values", [v for v in VALUES_NAMES if v != "minimal-values.yaml"])
def test_gateway_config_and_keys_load_in_the_gateway(
    rendered: dict[str, list[dict[str, Any]]], values: str, tmp_path: Path
) -> None:
    from kvserve.gateway.config import GatewayConfig, load_config
    from kvserve.gateway.keys import load_keys
    from kvserve.gateway.main import add_arguments

    objects = rendered[values]
    text = find(objects, "ConfigMap", GATEWAY)["data"]["gateway.yaml"]
    if "discovery" in yaml.safe_load(text) and "discovery" not in GatewayConfig.model_fields:
        pytest.skip("the gateway's config has no `discovery` section yet")
    (tmp_path / "gateway.yaml").write_text(text)
    config = load_config(tmp_path / "gateway.yaml")  # raises ConfigError naming the problem

    deployment = find(objects, "Deployment", GATEWAY)
    pod = deployment["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"][:2] == ["kvserve", "gateway"]
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(c["command"][2:] + c["args"])
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts[args.config]["subPath"] == "gateway.yaml"
    assert config.listen.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert config.listen.port == ports["http"]
    assert config.listen.metrics_port == ports.get("metrics")
    keys_dir = str(Path(config.keys_file).parent)
    assert mounts[keys_dir]["name"] == "keys" and "subPath" not in mounts[keys_dir]
    assert Path(config.keys_file).name == "keys.yaml"
    service = find(objects, "Service", GATEWAY)
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert re.fullmatch(r"[0-9a-f]{64}", annotations["checksum/config"])

    keys_secret = f"{GATEWAY}-keys"
    secrets = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == keys_secret]
    for secret in secrets:
        data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        data.update(secret.get("stringData") or {})
        (tmp_path / "keys.yaml").write_text(data["keys.yaml"])
        keys = load_keys(tmp_path / "keys.yaml")
        if "api-key" in data:  # source=generate
            assert data["api-key"].startswith("sk-kvs-") and len(data["api-key"]) == 50
            assert [k.sha256 for k in keys.keys] == [
                hashlib.sha256(data["api-key"].encode()).hexdigest()
            ]


def test_a_config_change_rolls_the_gateway_pods(chart: Path) -> None:
    def checksum(*sets: str) -> str:
        deployment = find(render(chart, "default-values.yaml", sets=sets), "Deployment", GATEWAY)
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum() == checksum()
    assert checksum("gateway.config.retry.max_attempts=3") != checksum()
    # Keys are hot-reloaded: changing where they come from is not a config change.
    assert checksum("gateway.keys.source=generate") == checksum()


def test_the_gateway_metrics_port_moves_every_scrape_target(chart: Path) -> None:
    """gateway.metricsPort: the config's listen.metrics_port, a container port, a ClusterIP
    Service of its own (never the API's Service) and the ServiceMonitor and annotation on
    it; without it, /metrics stays on the API's port."""

    def gateway_objects(*sets: str) -> dict[str, Any]:
        objects = render(
            chart, "default-values.yaml", sets=("metrics.serviceMonitor.enabled=true", *sets)
        )
        deployment = find(objects, "Deployment", GATEWAY)
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        config = yaml.safe_load(find(objects, "ConfigMap", GATEWAY)["data"]["gateway.yaml"])
        return {
            "listen": config["listen"],
            "ports": {p["name"]: p["containerPort"] for p in container["ports"]},
            "annotation": deployment["spec"]["template"]["metadata"]["annotations"][
                "prometheus.io/port"
            ],
            "services": {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"},
            "monitor": find(objects, "ServiceMonitor", GATEWAY)["spec"],
        }

    default = gateway_objects()
    limits = {  # values.yaml's config.listen, passed through
        "max_header_bytes": 65536,
        "header_timeout_seconds": 10,
        "body_timeout_seconds": 30,
        "keep_alive_seconds": 75,
        "refusals_per_second": 100,
    }
    assert default["listen"] == {"host": "0.0.0.0", "port": 8080, **limits}
    assert default["ports"] == {"http": 8080} and default["annotation"] == "8080"
    assert f"{GATEWAY}-metrics" not in default["services"]
    assert default["monitor"]["endpoints"][0]["port"] == "http"

    apart = gateway_objects("gateway.metricsPort=9090", "gateway.service.type=LoadBalancer")
    assert apart["listen"] == {"host": "0.0.0.0", "port": 8080, "metrics_port": 9090, **limits}
    assert apart["ports"] == {"http": 8080, "metrics": 9090} and apart["annotation"] == "9090"
    api = apart["services"][GATEWAY]["spec"]
    assert [p["name"] for p in api["ports"]] == ["http"], "the LoadBalancer must not carry it"
    metrics = apart["services"][f"{GATEWAY}-metrics"]
    assert metrics["spec"]["type"] == "ClusterIP"
    assert metrics["spec"]["ports"] == [
        {
            "name": "metrics",
            "port": 9090,
            "targetPort": "metrics",
            "protocol": "TCP",
            "appProtocol": "http",
        }
    ]
    assert metrics["spec"]["selector"] == api["selector"]
    assert apart["monitor"]["endpoints"][0]["port"] == "metrics"
    selector = apart["monitor"]["selector"]["matchLabels"]
    assert selector.items() <= metrics["metadata"]["labels"].items()
    assert not selector.items() <= apart["services"][GATEWAY]["metadata"]["labels"].items()


def test_gateway_config_values_schema_follows_the_gateway() -> None:
    """values.schema.json lists the gateway's config fields (so a typo fails helm install):
    it must list exactly the fields the gateway knows, except those the chart sets."""
    from pydantic import BaseModel

    from kvserve.gateway import config as gw
    from kvserve.gateway import keys

    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]["gateway"]["properties"]["config"]["properties"]
    chart_owned = {"keys_file", "discovery"}
    assert set(props) == set(gw.GatewayConfig.model_fields) - chart_owned
    listen_owned = {"host", "port", "metrics_port"}  # gateway.port, gateway.metricsPort
    assert set(props["listen"]["properties"]) == set(gw.ListenConfig.model_fields) - listen_owned
    for name, model in (
        ("routing", gw.RoutingConfig),
        ("admission", gw.AdmissionConfig),
        ("retry", gw.RetryConfig),
    ):
        assert set(props[name]["properties"]) == set(model.model_fields), name
    models = props["models"]["additionalProperties"]["properties"]
    assert set(models) == set(gw.ModelConfig.model_fields)
    entry = schema["definitions"]["keyEntry"]["properties"]
    assert set(entry) == set(keys.KeyEntry.model_fields)
    assert set(schema["definitions"]["keyLimits"]["properties"]) == set(keys.KeyLimits.model_fields)
    assert issubclass(gw.GatewayConfig, BaseModel)


# ---------------------------------------------------------------------------- the hooks


def job_script(objects: list[dict[str, Any]], name: str) -> tuple[str, dict[str, str]]:
    job = find(objects, "Job", name)
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["python", "-c"]
    env = {e["name"]: e.get("value", "") for e in c["env"]}
    return c["command"][2], env


def test_cleanup_hook_may_delete_only_the_example_models(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["all-features-values.yaml"]
    job = find(objects, "Job", "kvs-kvserve-cleanup")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    script, env = job_script(objects, "kvs-kvserve-cleanup")
    compile(script, "cleanup-job", "exec")
    assert json.loads(env["MODELS"]) == [[NAMESPACE, "travel-tiny"], ["models", "llama-8b"]]
    roles = {r["metadata"]["namespace"]: r["rules"] for r in objects if r["kind"] == "Role"}
    assert roles == {
        ns: [
            {
                "apiGroups": ["kvserve.dev"],
                "resources": ["inferencemodels"],
                "resourceNames": [name],
                "verbs": ["get", "delete"],
            }
        ]
        for ns, name in ((NAMESPACE, "travel-tiny"), ("models", "llama-8b"))
    }
    for values in ("default-values.yaml", "minimal-values.yaml"):
        assert not [o for o in rendered[values] if "cleanup" in o["metadata"]["name"]]


class _Gateway(BaseHTTPRequestHandler):
    key = "sk-kvs-test"

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self.send_error(404)
        elif self.headers.get("Authorization") != f"Bearer {self.key}":
            self.send_response(401)
            self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
        else:
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("with_key", [False, True])
def test_helm_test_script_accepts_the_gateways_answers(
    rendered: dict[str, list[dict[str, Any]]], with_key: bool
) -> None:
    """kwok never runs the test pod: its script runs here against a stand-in gateway."""
    script, env = job_script(rendered["static-values.yaml"], "kvs-kvserve-test")
    assert env["GATEWAY_URL"] == f"http://{GATEWAY}:8080"
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"GATEWAY_URL": f"http://127.0.0.1:{server.server_address[1]}"}
        if with_key:
            env["KVSERVE_API_KEY"] = _Gateway.key
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("['m']" if with_key else "401 without a key") in proc.stdout


# ------------------------------------------------------------- dashboards and the rules


def test_dashboards_are_config_maps_for_the_grafana_sidecar(chart: Path) -> None:
    files = sorted((chart / "files" / "dashboards").glob("*.json"))
    objects = render(chart, "default-values.yaml")
    maps = [o for o in objects if o["metadata"]["name"].startswith("kvs-kvserve-dashboard-")]
    assert len(maps) == len(files)
    by_file = {next(iter(m["data"])): m for m in maps}
    assert set(by_file) == {f.name for f in files}
    for f in files:
        cm = by_file[f.name]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == NAMESPACE
        assert json.loads(cm["data"][f.name]) == json.loads(f.read_text())
        assert len(json.dumps(cm)) < 1_000_000, "a ConfigMap holds at most 1 MiB"
    custom = render(
        chart,
        "default-values.yaml",
        sets=(
            "dashboards.label=kvserve/dashboard",
            "dashboards.labelValue=yes",
            "dashboards.namespace=monitoring",
        ),
    )
    for cm in (o for o in custom if o["metadata"]["name"].startswith("kvs-kvserve-dashboard-")):
        assert cm["metadata"]["labels"]["kvserve/dashboard"] == "yes"
        assert "grafana_dashboard" not in cm["metadata"]["labels"]
        assert cm["metadata"]["namespace"] == "monitoring"
    off = render(chart, "default-values.yaml", sets=("dashboards.enabled=false",))
    assert not [o for o in off if "dashboard" in o["metadata"]["name"]]


def test_prometheus_rule_is_the_generated_rules_file(
    chart: Path, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    rules = yaml.safe_load((chart / "files" / "prometheus-rules.yaml").read_text())
    rule = find(rendered["all-features-values.yaml"], "PrometheusRule")
    assert rule["spec"]["groups"] == rules["groups"]


# ------------------------------------------------------------------ values are checked


SCHEMA_REJECTIONS = [
    # (--set, what the message must contain)
    ("gatway.replicas=1", ["additional properties 'gatway' not allowed"]),
    ("gateway.replicas=two", ["/gateway/replicas", "want integer"]),
    (
        "gateway.keys.source=vault",
        ["/gateway/keys/source", "one of 'existingSecret', 'inline', 'generate'"],
    ),
    ("gateway.keys.source=inline", ["/gateway/keys/inline"]),
    ("gateway.config.routing.polcy=prefix", ["/gateway/config/routing", "'polcy' not allowed"]),
    ("gateway.config.routing.policy=random", ["/gateway/config/routing/policy"]),
    ("gateway.config.listen.port=9000", ["/gateway/config/listen", "'port' not allowed"]),
    ("gateway.config.listen.refusals_per_second=-1", ["/gateway/config/listen/refusals"]),
    ("gateway.service.type=Ingress", ["/gateway/service/type"]),
    ("images.kvserve.pullPolicy=Sometimes", ["/images/kvserve/pullPolicy"]),
    ("images.operator.digest=abc", ["/images/operator/digest"]),
    ("operator.logFormat=yaml", ["/operator/logFormat"]),
    ("operator.watchNamespaces[0]=Team_A", ["/operator/watchNamespaces/0"]),
    ("dashboards.labelValue=1", ["/dashboards/labelValue", "want string"]),
    ("networkPolicy.egress.enabled=true", ["/networkPolicy/egress/apiServerCIDRs"]),
    ("inferenceModels[0].name=Bad_Name", ["/inferenceModels/0"]),
    ("metrics.serviceMonitor.interval=30", ["/metrics/serviceMonitor/interval"]),
    ("gateway.pdb.minAvailable=half", ["/gateway/pdb/minAvailable"]),
    ("gateway.metricsPort=0", ["/gateway/metricsPort"]),
    # What the API server would refuse at install, refused before anything is applied:
    ("nameOverride=Bad_Name", ["/nameOverride", "does not match pattern"]),
    ("tmpSizeLimit=lots", ["/tmpSizeLimit", "does not match pattern"]),
    ("commonLabels.a b=c", ["invalid propertyName 'a b'"]),
    ("gateway.podLabels.team=a b", ["/gateway/podLabels/team", "does not match pattern"]),
]


@pytest.mark.parametrize(
    ("setting", "expected"), SCHEMA_REJECTIONS, ids=[s for s, _ in SCHEMA_REJECTIONS]
)
def test_values_schema_rejects_mistakes_by_name(
    chart: Path, setting: str, expected: list[str]
) -> None:
    message = render_error(chart, setting)
    assert "values don't meet the specifications of the schema" in message, message
    for fragment in expected:
        assert fragment in message, message


TEMPLATE_FAILURES = [
    (("gateway.discovery.enabled=false",), "gateway.config.models.<name>.replicas"),
    (
        (
            "gateway.autoscaling.enabled=true",
            "gateway.autoscaling.minReplicas=5",
            "gateway.autoscaling.maxReplicas=3",
        ),
        "minReplicas (5) must not exceed maxReplicas (3)",
    ),
    (("operator.serviceAccount.create=false",), "operator.serviceAccount.name is required"),
    (
        ("gateway.metricsPort=8080",),
        "gateway.metricsPort (8080) must differ from gateway.port",
    ),
]


@pytest.mark.parametrize(
    ("sets", "expected"), TEMPLATE_FAILURES, ids=[s[0] for s, _ in TEMPLATE_FAILURES]
)
def test_inconsistent_values_fail_with_a_message(
    chart: Path, sets: tuple[str, ...], expected: str
) -> None:
    message = render_error(chart, *sets)
    assert expected in message, message


def test_prometheus_rule_without_the_rules_file_fails_clearly(tmp_path: Path) -> None:
    bare = tmp_path / "kvserve"
    import shutil

    shutil.copytree(CHART, bare)
    (bare / "files" / "prometheus-rules.yaml").unlink(missing_ok=True)
    message = render_error(bare, "metrics.prometheusRule.enabled=true")
    assert "needs files/prometheus-rules.yaml" in message, message


def test_kube_version_below_the_minimum_is_refused(chart: Path) -> None:
    assert HELM is not None
    proc = helm(HELM, "template", "kvs", str(chart), "--kube-version", "1.29.4", check=False)
    assert proc.returncode != 0
    assert "requires kubeVersion: >=1.30.0-0" in proc.stderr, proc.stderr


# --------------------------------------------------------------- values.yaml is documented


def _schema_paths(node: dict[str, Any], defs: dict[str, Any], prefix: str = "") -> set[str]:
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[1]]
    out = set()
    for name, child in (node.get("properties") or {}).items():
        path = f"{prefix}.{name}" if prefix else name
        out.add(path)
        if path in ("gateway.config", "inferenceModels"):
            continue  # passed through; checked against the gateway / the CRD elsewhere
        out |= _schema_paths(child, defs, path)
    return out


def _values_paths(node: Any, prefix: str = "") -> set[str]:
    out = set()
    if isinstance(node, dict):
        for name, child in node.items():
            path = f"{prefix}.{name}" if prefix else str(name)
            out.add(path)
            if path not in ("gateway.config",) and not isinstance(child, list):
                free_form = name in (
                    "resources",
                    "podSecurityContext",
                    "securityContext",
                    "behavior",
                ) or name.endswith("Probe")
                if not free_form:
                    out |= _values_paths(child, path)
    return out


def test_values_yaml_and_schema_describe_the_same_keys() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    in_schema = _schema_paths(schema, schema["definitions"]) - {"global"}
    in_values = _values_paths(values)
    assert in_values - in_schema == set(), "keys in values.yaml the schema does not know"
    missing = {
        p
        for p in in_schema - in_values
        if not p.startswith(("gateway.keys.inline", "tests.resources"))
    }
    # Keys the schema accepts that values.yaml does not show must be optional sub-keys of
    # maps shown there (e.g. resources.claims); a documented key is shown in values.yaml.
    assert {p for p in missing if p.count(".") < 2} == set(), missing


def undocumented_values(text: str, max_indent: int = 4) -> list[str]:
    """Keys of values.yaml (indented at most ``max_indent``) without a comment. A key is
    documented by a comment line right above it, by following a documented sibling on
    the next line (one comment for a group: podAnnotations / podLabels), or, for a
    block, by every key in it being documented. The keys inside a Kubernetes object
    passed through as written (resources, security contexts, probes) are its own."""
    free_form = {"resources", "podSecurityContext", "securityContext"}
    lines = text.splitlines()
    key_line = re.compile(r"^( *)([A-Za-z][A-Za-z0-9_]*):( *)(.*)$")
    keys: list[tuple[int, int, bool]] = []  # (line index, indent, opens a block)
    covered_below: int | None = None  # inside a commented free-form block (resources: …)
    for i, line in enumerate(lines):
        m = key_line.match(line)
        if not m:
            continue
        indent = len(m[1])
        if covered_below is not None and indent > covered_below:
            continue
        covered_below = None
        keys.append((i, indent, m[4].strip() == "" or m[4].startswith("#")))
        if m[2] in free_form or m[2].endswith("Probe"):
            covered_below = indent
    memo: dict[int, bool] = {}

    def documented(k: int) -> bool:
        if k in memo:
            return memo[k]
        i, indent, block = keys[k]
        above = lines[i - 1].strip() if i else ""
        ok = above.startswith("#")
        if not ok and k and keys[k - 1][0] == i - 1 and keys[k - 1][1] == indent:
            ok = not keys[k - 1][2] and documented(k - 1)
        if not ok and block:
            children = []
            for j in range(k + 1, len(keys)):
                if keys[j][1] <= indent:
                    break
                if keys[j][1] == indent + 2:
                    children.append(j)
            ok = bool(children) and all(documented(j) for j in children)
        memo[k] = ok
        return ok

    return [
        f"line {i + 1}: {lines[i].strip()}"
        for k, (i, indent, _) in enumerate(keys)
        if indent <= max_indent and not documented(k)
    ]


def test_values_yaml_is_commented() -> None:
    assert undocumented_values((CHART / "values.yaml").read_text()) == []
    # The check itself: a key without a comment is found.
    assert undocumented_values("# a\na: 1\nb: 2\n\nc: 3\n") == ["line 5: c: 3"]
    assert undocumented_values("a:\n  # x\n  x: 1\n  y: 2\n") == []
    assert undocumented_values("a:\n  # x\n  x: 1\n\n  y: 2\n") == ["line 1: a:", "line 5: y: 2"]


def test_notes_and_readme_name_the_upgrade_story() -> None:
    readme = (CHART / "README.md").read_text()
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    command = "kubectl apply --server-side -f -"
    assert command in readme and command in notes
    assert "helm show crds" in readme and "helm show crds" in notes
    assert "kvserve gateway --new-key" in notes
    # The commands in NOTES are plain shell (no unbalanced quotes in the rendered text).
    for line in notes.splitlines():
        if line.strip().startswith(("kubectl", "helm")) and "{{" not in line:
            shlex.split(line)
