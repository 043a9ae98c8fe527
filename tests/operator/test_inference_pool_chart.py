"""The Helm chart's switch for InferencePools (operator.inferencePool.enabled), rendered
with the real helm binary of tests/cluster as tests/chart does: off, the operator's
ClusterRole is exactly manifests/rbac.yaml; on, it adds exactly the rules of
manifests/rbac-inference-pool.yaml, in both the cluster-wide and the namespaced mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart import (
    CHART,
    REPO,
    documents,
    find,
    helm,
    helm_binary,
    prepared_chart,
    template_args,
)

HELM = helm_binary()
if HELM is None:
    pytest.skip(
        "helm is not built (tests/cluster/build.py builds it; needs Go)", allow_module_level=True
    )

MANIFESTS = REPO / "operator" / "kvserve_operator" / "manifests"
OPERATOR = "kvs-kvserve-operator"
ON = "operator.inferencePool.enabled=true"


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepared_chart(tmp_path_factory.mktemp("chart"))


def render(chart: Path, *sets: str) -> list[dict[str, Any]]:
    assert HELM is not None
    return documents(helm(HELM, *template_args(chart, sets=sets, include_crds=False)).stdout)


def rules(name: str) -> list[dict[str, Any]]:
    return yaml.safe_load((MANIFESTS / name).read_text())["rules"]  # type: ignore[no-any-return]


def test_the_charts_copy_is_the_operators_manifest() -> None:
    copy = CHART / "files" / "operator-rbac-inference-pool-rules.yaml"
    manifest = MANIFESTS / "rbac-inference-pool.yaml"
    assert copy.read_bytes() == manifest.read_bytes(), (
        f"the chart's copy is stale: cp {manifest.relative_to(REPO)} {copy.relative_to(REPO)}"
    )


def test_off_by_default(chart: Path) -> None:
    role = find(render(chart), "ClusterRole", OPERATOR)
    assert role["rules"] == rules("rbac.yaml")
    assert "inferencepools" not in yaml.safe_dump(role)


def test_on_adds_exactly_the_inference_pool_rules(chart: Path) -> None:
    role = find(render(chart, ON), "ClusterRole", OPERATOR)
    assert role["rules"] == rules("rbac.yaml") + rules("rbac-inference-pool.yaml")


def test_on_in_namespaced_mode_grants_pools_only_in_the_watched_namespaces(chart: Path) -> None:
    objects = render(chart, ON, "operator.watchNamespaces={team-a,team-b}")
    role = find(objects, "ClusterRole", OPERATOR)
    assert role["rules"] == rules("rbac.yaml") + rules("rbac-inference-pool.yaml")
    bindings = [
        o for o in objects if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == OPERATOR
    ]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert not any(
        o["kind"] == "ClusterRoleBinding" and o["roleRef"]["name"] == OPERATOR for o in objects
    )
    cluster_wide = find(objects, "ClusterRole", f"{OPERATOR}-cluster")
    assert "inferencepools" not in yaml.safe_dump(cluster_wide)


def test_a_misspelt_value_is_refused_by_the_schema(chart: Path) -> None:
    assert HELM is not None
    proc = helm(
        HELM,
        *template_args(chart, sets=("operator.inferencePool.enable=true",), include_crds=False),
        check=False,
    )
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert "enable" in proc.stderr
