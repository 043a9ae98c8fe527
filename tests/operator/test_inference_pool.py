"""spec.inferencePool without a cluster: the spec, the rendered InferencePool and pod
template, status.inferencePool and the Ready condition, the CRD's schema for them, and
the operator's extra RBAC rules.

The rendered pool is also checked against the schema of GIE's own CRD (the vendored
tests/cluster/crds copy); the API server's verdict is in test_inference_pool_e2e.py.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserve_operator.constants import (
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_CRD_NAME,
    INFERENCE_POOL_KIND,
)
from kvserve_operator.render import (
    HTTP_PORT,
    POOL_LABEL,
    OperatorSettings,
    pool_selector_labels,
    render_children,
    render_deployment,
    render_inference_pool,
    selector_labels,
)
from kvserve_operator.spec import (
    DEFAULT_PICKER_PORT,
    FAILURE_MODES,
    EndpointPickerRefSpec,
    InferencePoolSpec,
    SpecError,
    parse_spec,
)
from kvserve_operator.status import (
    POOL_CRD_MISSING,
    compute_status,
    inference_pool_status,
)

REPO = Path(__file__).resolve().parents[2]
GIE_CRD = REPO / "tests" / "cluster" / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
MINIMAL: dict[str, Any] = {"model": {"source": "hf://Qwen/Qwen3-0.6B"}}
POOL_ON: dict[str, Any] = {"enabled": True, "endpointPickerRef": {"name": "llm-epp"}}
NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def spec_with(pool: dict[str, Any] | None) -> Any:
    body = copy.deepcopy(MINIMAL)
    if pool is not None:
        body["inferencePool"] = pool
    return parse_spec(body)


def engine(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "engine")  # type: ignore[no-any-return]


def deployment(spec: Any) -> dict[str, Any]:
    return render_deployment("llm", "models", "uid-1", spec, OperatorSettings(), 2)


# ---- spec -------------------------------------------------------------------------------


def test_off_by_default() -> None:
    assert spec_with(None).inference_pool == InferencePoolSpec()
    assert InferencePoolSpec().enabled is False


def test_picker_defaults_are_gies() -> None:
    ref = spec_with(POOL_ON).inference_pool.endpoint_picker_ref
    assert ref == EndpointPickerRefSpec(name="llm-epp", port=9002, failure_mode="FailClose")


@pytest.mark.parametrize(
    ("pool", "path", "fragment"),
    [
        ({"enabled": True}, "spec.inferencePool.endpointPickerRef", "required when"),
        ({"endpointPickerRef": {}}, "spec.inferencePool.endpointPickerRef.name", "required"),
        (
            {"endpointPickerRef": {"name": "e", "port": 0}},
            "spec.inferencePool.endpointPickerRef.port",
            "between 1 and 65535",
        ),
        (
            {"endpointPickerRef": {"name": "e", "failureMode": "Open"}},
            "spec.inferencePool.endpointPickerRef.failureMode",
            "must be one of",
        ),
        ({"enable": True}, "spec.inferencePool.enable", "unknown field"),
    ],
)
def test_invalid_pool_specs(pool: dict[str, Any], path: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        spec_with(pool)
    assert info.value.path == path
    assert fragment in info.value.message


# ---- rendering --------------------------------------------------------------------------


def test_off_renders_no_pool_and_the_same_pods() -> None:
    off = spec_with(None)
    assert render_inference_pool("llm", "models", "uid-1", off) is None
    # A picker named but the pool off changes nothing either.
    named = spec_with({"enabled": False, "endpointPickerRef": {"name": "llm-epp"}})
    assert render_inference_pool("llm", "models", "uid-1", named) is None
    assert deployment(named) == deployment(off)
    template = deployment(off)["spec"]["template"]
    assert POOL_LABEL not in template["metadata"]["labels"]
    assert "--metrics-compat" not in engine(deployment(off))["args"]
    kinds = [c["kind"] for c in render_children("llm", "models", "uid", off, OperatorSettings(), 1)]
    assert INFERENCE_POOL_KIND not in kinds


def test_on_labels_the_pods_and_turns_on_vllm_metrics() -> None:
    body = {**MINIMAL, "inferencePool": POOL_ON, "engine": {"extraArgs": ["--seed=1"]}}
    d = deployment(parse_spec(body))
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert labels[POOL_LABEL] == "llm"
    # The Deployment's selector is immutable: turning the pool on must not touch it.
    assert d["spec"]["selector"] == {"matchLabels": selector_labels("llm")}
    args = engine(d)["args"]
    i = args.index("--metrics-compat")
    assert args[i + 1] == "vllm"
    assert args[-1] == "--seed=1"  # extraArgs still come last


def test_rendered_pool() -> None:
    spec = spec_with(
        {
            "enabled": True,
            "endpointPickerRef": {"name": "llm-epp", "port": 9100, "failureMode": "FailOpen"},
        }
    )
    pool = render_inference_pool("llm", "models", "uid-1", spec)
    assert pool is not None
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    assert pool["apiVersion"] == INFERENCE_POOL_API_VERSION
    meta = pool["metadata"]
    assert (meta["name"], meta["namespace"]) == ("llm", "models")
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "kvserve.dev/v1alpha1",
            "kind": "InferenceModel",
            "name": "llm",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert pool["spec"] == {
        "selector": {"matchLabels": pool_selector_labels("llm")},
        "targetPorts": [{"number": HTTP_PORT}],
        "endpointPickerRef": {
            "group": "",
            "kind": "Service",
            "name": "llm-epp",
            "port": {"number": 9100},
            "failureMode": "FailOpen",
        },
    }


def test_pool_selects_exactly_the_pods_rendered_with_it() -> None:
    on, off = spec_with(POOL_ON), spec_with(None)
    pool = render_inference_pool("llm", "models", "uid-1", on)
    assert pool is not None
    wanted = pool["spec"]["selector"]["matchLabels"].items()
    pod_on = deployment(on)["spec"]["template"]["metadata"]["labels"]
    pod_off = deployment(off)["spec"]["template"]["metadata"]["labels"]
    assert wanted <= pod_on.items()
    assert not wanted <= pod_off.items()  # pods of the old template (no vLLM names) stay out
    other = render_deployment("other", "models", "u", on, OperatorSettings(), 1)
    assert not wanted <= other["spec"]["template"]["metadata"]["labels"].items()
    # The pool's target port is the engine's HTTP port, where /metrics is served too.
    http = next(p for p in engine(deployment(on))["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]


def _check_against(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Type, properties, required and enum of an OpenAPI v3 node (enough for the pool)."""
    problems: list[str] = []
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}
    if kind in types and not isinstance(value, types[kind]):
        return [f"{path}: not a {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{path}: {value!r} not in {schema['enum']}")
    if kind == "string" and "maxLength" in schema and len(value) > schema["maxLength"]:
        problems.append(f"{path}: too long")
    if kind == "integer" and not schema.get("minimum", value) <= value <= schema.get(
        "maximum", value
    ):
        problems.append(f"{path}: out of range")
    if kind == "object":
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key in schema.get("required") or []:
            if key not in value:
                problems.append(f"{path}.{key}: required")
        for key, child in value.items():
            if key in props:
                problems += _check_against(props[key], child, f"{path}.{key}")
            elif isinstance(extra, dict):
                problems += _check_against(extra, child, f"{path}.{key}")
            elif path != "":  # metadata is the API server's
                problems.append(f"{path}.{key}: not in the schema")
    if kind == "array":
        for i, item in enumerate(value):
            problems += _check_against(schema["items"], item, f"{path}[{i}]")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            problems.append(f"{path}: too many items")
    return problems


def test_rendered_pool_fits_gies_own_crd() -> None:
    crd = yaml.safe_load(GIE_CRD.read_text())
    assert crd["metadata"]["name"] == INFERENCE_POOL_CRD_NAME
    assert crd["spec"]["names"]["kind"] == INFERENCE_POOL_KIND
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    pool = render_inference_pool("llm", "models", "uid-1", spec_with(POOL_ON))
    assert pool is not None
    assert _check_against(schema, pool["spec"], "spec") == []
    # The picker's defaults here are the CRD's.
    ref = schema["properties"]["endpointPickerRef"]["properties"]
    assert ref["failureMode"]["default"] == "FailClose"
    assert tuple(ref["failureMode"]["enum"]) == FAILURE_MODES
    assert ref["name"]["maxLength"] == 253
    assert DEFAULT_PICKER_PORT == 9002


# ---- status -----------------------------------------------------------------------------


def _ready(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Ready")  # type: ignore[no-any-return]


def test_a_pool_problem_makes_ready_false_with_its_reason() -> None:
    ready_deployment = {
        "metadata": {"generation": 1},
        "status": {
            "observedGeneration": 1,
            "replicas": 1,
            "readyReplicas": 1,
            "updatedReplicas": 1,
            "availableReplicas": 1,
        },
    }
    common: dict[str, Any] = {
        "generation": 1,
        "desired_replicas": 1,
        "deployment": ready_deployment,
        "previous": {},
        "error": None,
        "now": NOW,
    }
    assert _ready(compute_status(**common))["status"] == "True"
    status = compute_status(**common, pool_problem=(POOL_CRD_MISSING, "install GIE's CRDs"))
    ready = _ready(status)
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "False",
        "InferencePoolCRDMissing",
        "install GIE's CRDs",
    )
    assert status["readyReplicas"] == 1  # the replicas still say what they are


def test_status_copies_the_pools_parents() -> None:
    assert inference_pool_status("llm", None) == {"name": "llm", "parents": []}
    pool = {
        "status": {
            "parents": [
                {
                    "parentRef": {
                        "group": "gateway.networking.k8s.io",
                        "kind": "Gateway",
                        "name": "inference-gateway",
                        "namespace": "models",
                    },
                    "controllerName": "gateway.envoyproxy.io/gatewayclass-controller",
                    "conditions": [
                        {
                            "type": "Accepted",
                            "status": "True",
                            "reason": "Accepted",
                            "message": "",
                            "lastTransitionTime": "2026-12-01T12:00:00Z",
                            "observedGeneration": 1,
                            "somethingNew": "dropped: the status schema is strict",
                        }
                    ],
                }
            ]
        }
    }
    (parent,) = inference_pool_status("llm", pool)["parents"]
    assert parent["parentRef"]["name"] == "inference-gateway"
    assert parent["controllerName"] == "gateway.envoyproxy.io/gatewayclass-controller"
    assert parent["conditions"] == [
        {
            "type": "Accepted",
            "status": "True",
            "reason": "Accepted",
            "message": "",
            "lastTransitionTime": "2026-12-01T12:00:00Z",
            "observedGeneration": 1,
        }
    ]


# ---- the CRD ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    text = resources.files("kvserve_operator").joinpath("manifests", "crd.yaml").read_text()
    (version,) = yaml.safe_load(text)["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def test_crd_spec_fields(schema: dict[str, Any]) -> None:
    pool = schema["properties"]["spec"]["properties"]["inferencePool"]
    assert pool["default"] == {}
    (rule,) = pool["x-kubernetes-validations"]
    # The same message as spec.py's, so kubectl and the operator say the same thing.
    assert rule["message"] == (
        "inferencePool.endpointPickerRef is required when inferencePool.enabled is true"
    )
    ref = pool["properties"]["endpointPickerRef"]
    assert ref["required"] == ["name"]
    assert tuple(ref["properties"]["failureMode"]["enum"]) == FAILURE_MODES
    assert ref["properties"]["port"]["default"] == DEFAULT_PICKER_PORT
    assert (ref["properties"]["port"]["minimum"], ref["properties"]["port"]["maximum"]) == (
        1,
        65535,
    )


def test_crd_status_fields(schema: dict[str, Any]) -> None:
    pool = schema["properties"]["status"]["properties"]["inferencePool"]
    assert set(pool["properties"]) == {"name", "parents"}
    parent = pool["properties"]["parents"]["items"]["properties"]
    assert set(parent) == {"parentRef", "controllerName", "conditions"}
    condition = parent["conditions"]["items"]["properties"]
    assert set(condition) == {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }


# ---- RBAC -------------------------------------------------------------------------------


def _rules(name: str) -> set[tuple[str, str, str]]:
    text = resources.files("kvserve_operator").joinpath("manifests", name).read_text()
    return {
        (g, r, v)
        for rule in yaml.safe_load(text)["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def test_only_the_extra_role_grants_inference_pools() -> None:
    pool_rules = _rules("rbac-inference-pool.yaml")
    assert pool_rules == {
        ("inference.networking.k8s.io", "inferencepools", verb)
        for verb in ("get", "create", "patch", "delete")
    }
    assert not any(g == "inference.networking.k8s.io" for g, _, _ in _rules("rbac.yaml"))
