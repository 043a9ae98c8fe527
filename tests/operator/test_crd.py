"""The InferenceModel CRD, the spec parser that mirrors it, and the operator's RBAC.

Pure checks (no cluster): the CRD is a structural schema with descriptions, its
defaults equal spec.py's, its patterns and enums equal spec.py's constants, and the
ClusterRole grants what the operator does and nothing it does not.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest
import yaml

from kvserve.model.pull import ModelPullError, parse_source
from kvserve_operator import spec as spec_module
from kvserve_operator.constants import CRD_NAME, GROUP, KIND, PLURAL, VERSION
from kvserve_operator.spec import (
    AutoscalingSpec,
    EngineSpec,
    HfTokenSecret,
    InferenceModelSpec,
    ModelSpec,
    SpecError,
    parse_spec,
)

MINIMAL: dict[str, Any] = {"model": {"source": "hf://Qwen/Qwen3-0.6B"}}


def _manifest(name: str) -> Any:
    text = resources.files("kvserve_operator").joinpath("manifests", name).read_text()
    return yaml.safe_load(text)


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    doc = _manifest("crd.yaml")
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    root = version["schema"]["openAPIV3Schema"]
    assert isinstance(root, dict)
    return root


@pytest.fixture(scope="module")
def spec_schema(schema: dict[str, Any]) -> dict[str, Any]:
    node = schema["properties"]["spec"]
    assert isinstance(node, dict)
    return node


def _walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def _at(node: dict[str, Any], dotted: str) -> dict[str, Any]:
    for key in dotted.split("."):
        node = node["properties"][key]
    return node


# ---- the CRD itself ---------------------------------------------------------------------


def test_names_scope_and_version(crd: dict[str, Any]) -> None:
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == CRD_NAME == "inferencemodels.kvserve.dev"
    spec = crd["spec"]
    assert spec["group"] == GROUP
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": KIND,
        "listKind": f"{KIND}List",
        "plural": PLURAL,
        "singular": KIND.lower(),
        "shortNames": ["im"],
        "categories": ["kvserve"],
    }
    (version,) = spec["versions"]
    assert version["name"] == VERSION
    assert version["served"] is True
    assert version["storage"] is True


def test_status_and_scale_subresources(crd: dict[str, Any]) -> None:
    (version,) = crd["spec"]["versions"]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }


def test_printer_columns(crd: dict[str, Any]) -> None:
    (version,) = crd["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Model", "Source", "Replicas", "Ready", "Status", "Age"]
    assert columns["Model"]["jsonPath"] == ".spec.model.servedName"
    assert columns["Source"]["jsonPath"] == ".spec.model.source"
    assert columns["Source"]["priority"] == 1
    assert columns["Replicas"]["jsonPath"] == ".status.replicas"
    assert columns["Ready"]["jsonPath"] == ".status.readyReplicas"
    assert columns["Status"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Age"] == {
        "name": "Age",
        "type": "date",
        "jsonPath": ".metadata.creationTimestamp",
    }
    for column in columns.values():
        assert column["type"] in ("string", "integer", "number", "boolean", "date")


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    """Every node has a type (or is int-or-string / preserves unknown fields)."""
    problems: list[str] = []
    for path, node in _walk(schema, "root"):
        if node.get("x-kubernetes-int-or-string"):
            # The only allowed anyOf: [{type: integer}, {type: string}], no type of its own.
            if "type" in node or node.get("anyOf") != [{"type": "integer"}, {"type": "string"}]:
                problems.append(f"{path}: malformed int-or-string")
            continue
        if "anyOf" in node or "oneOf" in node or "allOf" in node or "not" in node:
            problems.append(f"{path}: logical junctors are not used outside int-or-string")
        kind = node.get("type")
        if kind not in ("object", "array", "string", "integer", "number", "boolean"):
            problems.append(f"{path}: no valid type ({kind!r})")
        if kind == "array" and not isinstance(node.get("items"), dict):
            problems.append(f"{path}: array without items")
        if kind == "object" and not (
            "properties" in node
            or "additionalProperties" in node
            or node.get("x-kubernetes-preserve-unknown-fields")
        ):
            problems.append(f"{path}: object without properties")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{path}: properties and additionalProperties are exclusive")
        for key in node.get("required", []):
            if key not in node.get("properties", {}):
                problems.append(f"{path}: required {key!r} is not a property")
    assert problems == []


def test_preserve_unknown_fields_only_where_intended(schema: dict[str, Any]) -> None:
    preserved = sorted(
        path for path, node in _walk(schema, "") if node.get("x-kubernetes-preserve-unknown-fields")
    )
    assert preserved == [".spec.env[]", ".spec.resources.tolerations[]"]


def test_every_property_has_a_description(schema: dict[str, Any]) -> None:
    missing = [
        path
        for path, node in _walk(schema, "")
        if not path.endswith(("[]", "{}")) and not str(node.get("description", "")).strip()
    ]
    # The API server refuses anything on metadata but restrictions of name/generateName.
    assert missing == [".metadata"]
    assert set(schema["properties"]["metadata"]) == {"type", "properties"}
    assert set(schema["properties"]["metadata"]["properties"]) == {"name", "generateName"}


def test_int64_fields(schema: dict[str, Any]) -> None:
    status = schema["properties"]["status"]
    for field in ("weightBytes", "kvBytesPerToken", "tokensPerReplica"):
        assert _at(status, f"capacity.{field}") == {
            **_at(status, f"capacity.{field}"),
            "type": "integer",
            "format": "int64",
        }
    assert _at(status, "observedGeneration")["format"] == "int64"


def test_status_schema(schema: dict[str, Any]) -> None:
    status = schema["properties"]["status"]
    assert not status.get("x-kubernetes-preserve-unknown-fields")
    assert set(status["properties"]) == {
        "observedGeneration",
        "replicas",
        "readyReplicas",
        "updatedReplicas",
        "availableReplicas",
        "selector",
        "conditions",
        "endpoint",
        "capacity",
        "capacityError",
        "autoscaling",
        "adapters",
        "inferencePool",
    }
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    item = conditions["items"]
    assert set(item["required"]) == {"type", "status"}
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"
    assert set(_at(status, "endpoint")["properties"]) == {
        "service",
        "host",
        "httpPort",
        "grpcPort",
        "metricsPort",
        "url",
    }
    assert set(_at(status, "capacity")["properties"]) == {
        "tensorParallelSize",
        "weightBytes",
        "kvBytesPerToken",
        "tokensPerReplica",
        "source",
    }
    assert set(_at(status, "autoscaling")["properties"]) == {
        "desiredReplicas",
        "currentMetric",
        "lastScaleTime",
        "reason",
    }
    assert _at(status, "autoscaling.lastScaleTime")["format"] == "date-time"


def test_name_is_limited_for_derived_names(schema: dict[str, Any]) -> None:
    assert _at(schema, "metadata.name")["maxLength"] == 52
    # Declaring generateName too keeps the apiserver from replacing the metadata schema
    # (and so the maxLength that bounds the CEL rule's cost).
    assert _at(schema, "metadata.generateName")["type"] == "string"
    # The first rule on the object; the second is the adapters' (tests/operator/test_adapters.py).
    rule = schema["x-kubernetes-validations"][0]
    assert "self.metadata.name.size() <= 52" in rule["rule"]
    pattern = re.findall(r"matches\('([^']*)'\)", rule["rule"])[0]
    for ok in ("llama", "a", "llama-3-8b", "m" * 52):
        assert re.fullmatch(pattern, ok), ok
    for bad in ("Llama", "8b", "llama.8b", "llama-", "-x", "llama_8b"):
        assert not re.fullmatch(pattern, bad), bad
    assert "DNS-1035" in rule["message"]


def test_model_source_rule_agrees_with_parse_source(spec_schema: dict[str, Any]) -> None:
    """The CEL rule is a first guard; anything it lets through parse_source must judge."""
    source = _at(spec_schema, "model.source")
    (rule,) = source["x-kubernetes-validations"]
    assert rule["message"].startswith("model.source must be hf://org/name[@revision]")
    patterns = re.findall(r"matches\('([^']*)'\)", rule["rule"])
    assert len(patterns) == 3

    def cel_accepts(text: str) -> bool:
        return any(re.fullmatch(p, text) for p in patterns)

    good = [
        "hf://Qwen/Qwen3-0.6B",
        "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f249a16976918f6564b8830bc894c89659",
        "hf://org/name@main",
        "hf://org/name@refs/pr/1",
        "pvc://models",
        "pvc://models/llama/8b",
        "pvc://my.claim-1/a",
        "file:///models-baked/llama",
        "file:///opt/model",
    ]
    bad = [
        "",
        "Qwen/Qwen3-0.6B",
        "s3://bucket/model",
        "hf://Qwen",
        "hf://Qwen/",
        "hf://a/b/c",
        "hf:///Qwen/Qwen3",
        "pvc://Models/x",
        "pvc://",
        "file://relative/path",
        "https://huggingface.co/Qwen/Qwen3-0.6B",
    ]
    for text in good:
        assert cel_accepts(text), text
        parse_source(text)
    for text in bad:
        assert not cel_accepts(text), text
        with pytest.raises(ModelPullError):
            parse_source(text)


def test_extra_args_rule_matches_owned_flags(spec_schema: dict[str, Any]) -> None:
    extra = _at(spec_schema, "engine.extraArgs")
    (rule,) = extra["x-kubernetes-validations"]
    flags = re.findall(r"'(--[a-z-]+)'", rule["rule"])
    assert tuple(flags) == spec_module.OPERATOR_OWNED_FLAGS
    assert extra["maxItems"] and extra["items"]["maxLength"]  # bounds the rule's cost


def test_autoscaling_rules(spec_schema: dict[str, Any]) -> None:
    rules = {
        r["message"]: r["rule"]
        for r in spec_schema["properties"]["autoscaling"]["x-kubernetes-validations"]
    }
    # The exact CEL is checked against a real API server in tests/cluster; here: the two
    # rules exist, with the messages spec.py also uses.
    assert set(rules) == {
        "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
        "autoscaling.maxReplicas is required when autoscaling.enabled is true",
    }
    assert (
        "self.minReplicas <= self.maxReplicas"
        in rules["autoscaling.minReplicas must be <= autoscaling.maxReplicas"]
    )


def test_patterns_and_enums_match_spec_py(spec_schema: dict[str, Any]) -> None:
    for field in ("resources.cpu", "resources.memory", "modelCache.sizeLimit"):
        assert _at(spec_schema, field)["pattern"] == spec_module.QUANTITY_PATTERN, field
    assert (
        _at(spec_schema, "resources.gpuResourceName")["pattern"] == spec_module.GPU_RESOURCE_PATTERN
    )
    assert tuple(_at(spec_schema, "engine.dtype")["enum"]) == spec_module.DTYPES
    assert tuple(_at(spec_schema, "autoscaling.metric")["enum"]) == spec_module.METRICS
    assert tuple(_at(spec_schema, "imagePullPolicy")["enum"]) == spec_module.PULL_POLICIES
    assert tuple(_at(spec_schema, "modelCache.medium")["enum"]) == spec_module.CACHE_MEDIA


def test_tokenizer_is_not_part_of_the_api(spec_schema: dict[str, Any]) -> None:
    # `kvserve serve` has no separate tokenizer: it must be in the model directory.
    assert "tokenizer" not in spec_schema["properties"]["model"]["properties"]
    with pytest.raises(SpecError, match=r"spec\.model\.tokenizer: unknown field"):
        parse_spec({"model": {"source": "hf://a/b", "tokenizer": "hf://a/c"}})


# ---- defaults: CRD ↔ spec.py ------------------------------------------------------------

_FIELD_NAMES = {"gpuMemoryGiB": "gpu_memory_gib"}


def _snake(camel: str) -> str:
    return _FIELD_NAMES.get(camel) or re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def _dataclass_of(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                return arg
    return None


def _defaulted_fields(
    node: dict[str, Any], cls: type, path: str
) -> Iterator[tuple[str, Any, dataclasses.Field[Any], type]]:
    """(path, CRD default, dataclass field, dataclass) for every property of ``node``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, child in node["properties"].items():
        name = _snake(key)
        assert name in fields, f"{path}.{key} has no field {cls.__name__}.{name}"
        yield f"{path}.{key}", child.get("default", dataclasses.MISSING), fields[name], cls
        nested = _dataclass_of(hints[name])
        if nested is not None and child.get("type") == "object":
            yield from _defaulted_fields(child, nested, f"{path}.{key}")


def _field_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def test_every_spec_property_is_a_dataclass_field_and_back(spec_schema: dict[str, Any]) -> None:
    seen: dict[type, set[str]] = {}
    for _path, _default, field, cls in _defaulted_fields(spec_schema, InferenceModelSpec, "spec"):
        seen.setdefault(cls, set()).add(field.name)
    for cls, names in seen.items():
        assert {f.name for f in dataclasses.fields(cls)} == names, cls.__name__


def test_crd_defaults_equal_dataclass_defaults(spec_schema: dict[str, Any]) -> None:
    compared = 0
    for path, crd_default, field, _cls in _defaulted_fields(
        spec_schema, InferenceModelSpec, "spec"
    ):
        py_default = _field_default(field)
        if crd_default is dataclasses.MISSING:
            # No CRD default: Python must not invent one (None, empty, or required).
            assert py_default in (None, dataclasses.MISSING, {}, ()), path
            continue
        compared += 1
        if isinstance(crd_default, dict):
            assert crd_default == {}, path
            assert dataclasses.is_dataclass(py_default), path
        elif isinstance(crd_default, list):
            assert tuple(crd_default) == py_default, path
        else:
            assert type(crd_default) is type(py_default) or {
                type(crd_default),
                type(py_default),
            } == {int, float}, path
            assert crd_default == py_default, path
    assert compared >= 29  # sanity: the walk reached the nested objects


def _apply_defaults(node: dict[str, Any], value: Any) -> Any:
    """Default ``value`` as the API server does: missing properties get their default,
    and defaulted objects are defaulted further."""
    if isinstance(value, dict) and "properties" in node:
        for key, child in node["properties"].items():
            if key not in value and "default" in child:
                value[key] = copy.deepcopy(child["default"])
            if key in value:
                value[key] = _apply_defaults(child, value[key])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        value = [_apply_defaults(node["items"], v) for v in value]
    return value


@pytest.mark.parametrize(
    "partial",
    [
        MINIMAL,
        {"model": {"source": "hf://a/b", "hfTokenSecret": {"name": "hf"}}},
        {"model": {"source": "pvc://models/x"}, "autoscaling": {"enabled": True, "maxReplicas": 3}},
        {"model": {"source": "hf://a/b"}, "engine": {"dtype": "bfloat16"}, "resources": {}},
    ],
)
def test_parse_of_api_server_defaulted_spec_equals_parse_of_partial(
    spec_schema: dict[str, Any], partial: dict[str, Any]
) -> None:
    defaulted = _apply_defaults(spec_schema, copy.deepcopy(partial))
    assert defaulted != partial
    assert parse_spec(defaulted) == parse_spec(partial)


def test_minimal_spec_defaults() -> None:
    s = parse_spec(MINIMAL)
    assert s.model == ModelSpec(source="hf://Qwen/Qwen3-0.6B")
    assert s.replicas == 1
    assert s.autoscaling == AutoscalingSpec()
    assert s.engine == EngineSpec()
    assert s.resources.gpus == 1
    assert s.resources.gpu_resource_name == "nvidia.com/gpu"
    assert s.model_cache.size_limit == "100Gi"
    assert s.slo.attainment == 0.99
    assert s.image is None and s.image_pull_policy is None and s.env == ()
    assert s.source.kind == "hf" and s.source.repo_id == "Qwen/Qwen3-0.6B"


def test_full_spec_round_trip() -> None:
    s = parse_spec(
        {
            "model": {
                "source": "hf://org/name@v1",
                "servedName": "my-model",
                "hfTokenSecret": {"name": "hf", "key": "token"},
                "configMap": "cfg",
            },
            "replicas": 3,
            "autoscaling": {
                "enabled": True,
                "minReplicas": 0,
                "maxReplicas": 8,
                "metric": "inFlight",
                "target": 2.5,
                "scaleUpStabilizationSeconds": 0,
                "scaleDownDelaySeconds": 60,
            },
            "resources": {
                "gpus": 2,
                "gpuResourceName": "amd.com/gpu",
                "gpuMemoryGiB": 192,
                "cpu": 8,
                "memory": "64Gi",
                "nodeSelector": {"pool": "gpu"},
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
                "priorityClassName": "high",
            },
            "engine": {
                "dtype": "float16",
                "maxModelLen": 8192,
                "maxNumSeqs": 128,
                "maxNumBatchedTokens": 4096,
                "blockSize": 32,
                "kvCacheMemoryFraction": 0.8,
                "enablePrefixCaching": False,
                "drainTimeoutSeconds": 120,
                "extraArgs": ["--seed", "1"],
            },
            "image": "registry/kvserve:dev",
            "imagePullPolicy": "Always",
            "env": [{"name": "A", "value": "1"}],
            "modelCache": {"sizeLimit": "500Gi", "medium": "Memory"},
            "slo": {"ttftSeconds": 1, "tpotSeconds": 0.05, "attainment": 0.95},
        }
    )
    assert s.model.hf_token_secret == HfTokenSecret(name="hf", key="token")
    assert s.autoscaling.target == 2.5 and s.autoscaling.min_replicas == 0
    assert s.resources.gpu_memory_gib == 192.0 and isinstance(s.resources.gpu_memory_gib, float)
    assert s.resources.cpu == 8 and s.resources.memory == "64Gi"
    assert s.resources.tolerations == ({"key": "gpu", "operator": "Exists"},)
    assert s.engine.extra_args == ("--seed", "1")
    assert s.slo.ttft_seconds == 1.0 and isinstance(s.slo.ttft_seconds, float)
    assert s.model_cache.medium == "Memory"


# ---- invalid specs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "path", "fragment"),
    [
        ({}, "spec.model", "required"),
        ({"model": {}}, "spec.model.source", "required"),
        ({"model": {"source": "s3://b/m"}}, "spec.model.source", "unsupported model source"),
        ({"model": {"source": "hf://a--b/c"}}, "spec.model.source", "hf://ORG/NAME"),
        ({"model": "hf://a/b"}, "spec.model", "expected an object"),
        ({**MINIMAL, "replicas": -1}, "spec.replicas", "between 0 and"),
        ({**MINIMAL, "replicas": "2"}, "spec.replicas", "expected an integer"),
        ({**MINIMAL, "replicas": True}, "spec.replicas", "expected an integer"),
        ({**MINIMAL, "replicas": 1.5}, "spec.replicas", "expected an integer"),
        ({**MINIMAL, "replicaz": 1}, "spec.replicaz", "unknown field"),
        (
            {**MINIMAL, "autoscaling": {"enabled": True}},
            "spec.autoscaling.maxReplicas",
            "required when autoscaling.enabled is true",
        ),
        (
            {**MINIMAL, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
            "spec.autoscaling.minReplicas",
            "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
        ),
        ({**MINIMAL, "autoscaling": {"target": 0}}, "spec.autoscaling.target", "at least 0.01"),
        ({**MINIMAL, "autoscaling": {"metric": "qps"}}, "spec.autoscaling.metric", "one of"),
        ({**MINIMAL, "autoscaling": {"enabled": "yes"}}, "spec.autoscaling.enabled", "boolean"),
        ({**MINIMAL, "resources": {"gpus": -1}}, "spec.resources.gpus", "between 0 and"),
        (
            {**MINIMAL, "resources": {"gpuResourceName": "gpu"}},
            "spec.resources.gpuResourceName",
            "domain-qualified",
        ),
        ({**MINIMAL, "resources": {"memory": "lots"}}, "spec.resources.memory", "quantity"),
        ({**MINIMAL, "resources": {"cpu": 1.5}}, "spec.resources.cpu", "quantity"),
        (
            {**MINIMAL, "resources": {"nodeSelector": {"a": 1}}},
            "spec.resources.nodeSelector.a",
            "string",
        ),
        (
            {**MINIMAL, "resources": {"tolerations": ["x"]}},
            "spec.resources.tolerations[0]",
            "object",
        ),
        ({**MINIMAL, "engine": {"dtype": "fp8"}}, "spec.engine.dtype", "one of"),
        ({**MINIMAL, "engine": {"quantization": "int4"}}, "spec.engine.quantization", "one of"),
        ({**MINIMAL, "engine": {"kvCacheDtype": "fp8"}}, "spec.engine.kvCacheDtype", "one of"),
        (
            {**MINIMAL, "engine": {"maxNumSeqs": 5000}},
            "spec.engine.maxNumSeqs",
            "between 1 and 4096",
        ),
        ({**MINIMAL, "engine": {"blockSize": 0}}, "spec.engine.blockSize", "between 1 and 256"),
        (
            {**MINIMAL, "engine": {"kvCacheMemoryFraction": 1.5}},
            "spec.engine.kvCacheMemoryFraction",
            "at most 1",
        ),
        (
            {**MINIMAL, "engine": {"kvCacheMemoryFraction": 0}},
            "spec.engine.kvCacheMemoryFraction",
            "greater than 0",
        ),
        (
            {**MINIMAL, "engine": {"drainTimeoutSeconds": 3601}},
            "spec.engine.drainTimeoutSeconds",
            "between 0 and 3600",
        ),
        ({**MINIMAL, "engine": {"extraArgs": [1]}}, "spec.engine.extraArgs[0]", "string"),
        (
            {**MINIMAL, "engine": {"extraArgs": ["--seed", "1", "--port=9000"]}},
            "spec.engine.extraArgs[2]",
            "--port is set by the operator",
        ),
        ({**MINIMAL, "imagePullPolicy": "Sometimes"}, "spec.imagePullPolicy", "one of"),
        ({**MINIMAL, "image": ""}, "spec.image", "must not be empty"),
        ({**MINIMAL, "env": [{"value": "x"}]}, "spec.env[0].name", "required"),
        (
            {**MINIMAL, "env": [{"name": "A"}, {"name": "A", "value": "2"}]},
            "spec.env[1].name",
            "duplicate",
        ),
        ({**MINIMAL, "modelCache": {"medium": "Disk"}}, "spec.modelCache.medium", "one of"),
        ({**MINIMAL, "slo": {"attainment": 1.01}}, "spec.slo.attainment", "at most 1"),
        (
            {"model": {"source": "hf://a/b", "servedName": "x" * 257}},
            "spec.model.servedName",
            "longer than 256",
        ),
        (
            {"model": {"source": "hf://a/b", "hfTokenSecret": {"key": "k"}}},
            "spec.model.hfTokenSecret.name",
            "required",
        ),
        *(
            ({"model": {"source": "hf://a/b", "servedName": name}}, "spec.model.servedName", why)
            for name, why in [
                ("my model", "whitespace"),
                ("a\nb", "whitespace"),
                ("bell\x07", "control characters"),
                ("*", "reserved"),
            ]
        ),
    ],
)
def test_invalid_specs(spec: dict[str, Any], path: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    assert info.value.path == path
    assert fragment in info.value.message
    assert str(info.value) == f"{path}: {info.value.message}"


def test_integral_floats_are_integers() -> None:
    # JSON has one number type; 2.0 from a client is the integer 2 to the API server too.
    assert parse_spec({**MINIMAL, "replicas": 2.0}).replicas == 2


# ---- RBAC -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    doc = _manifest("rbac.yaml")
    assert doc["apiVersion"] == "rbac.authorization.k8s.io/v1"
    assert doc["kind"] == "ClusterRole"
    assert doc["metadata"]["name"] == "kvserve-operator"
    out = doc["rules"]
    assert isinstance(out, list)
    return out


def _granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


# What the operator server-side applies, reads back and deletes.
WRITES = {"get", "list", "watch", "create", "patch", "update", "delete"}
NEEDED: dict[tuple[str, str], set[str]] = {
    ("kvserve.dev", "inferencemodels"): {"get", "list", "watch", "patch", "update"},
    ("kvserve.dev", "inferencemodels/status"): {"get", "patch", "update"},
    # blockOwnerDeletion on the children (OwnerReferencesPermissionEnforcement).
    ("kvserve.dev", "inferencemodels/finalizers"): {"update"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "update", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): WRITES,
    ("", "services"): {"get", "list", "watch", "create", "patch", "update", "delete"},
    ("policy", "poddisruptionbudgets"): WRITES,
    ("", "pods"): {"get", "list", "watch"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch", "update", "delete"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("", "namespaces"): {"get", "list", "watch"},
}


def test_rbac_grants_exactly_what_the_operator_needs(rules: list[dict[str, Any]]) -> None:
    wanted = {(g, r, v) for (g, r), verbs in NEEDED.items() for v in verbs}
    assert _granted(rules) == wanted


def test_rbac_has_no_wildcards_secrets_or_peering(rules: list[dict[str, Any]]) -> None:
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
    granted = _granted(rules)
    assert not any(r == "secrets" for _, r, _ in granted)  # pods read HF tokens, not us
    assert not any(g == "kopf.dev" for g, _, _ in granted)  # --standalone: no peering


def test_rbac_rules_are_commented() -> None:
    text = resources.files("kvserve_operator").joinpath("manifests", "rbac.yaml").read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("- apiGroups:"):
            previous = lines[i - 1].strip()
            # A rule directly after another rule shares its comment (the two events APIs).
            assert previous.startswith("#") or previous.startswith("verbs:"), line
