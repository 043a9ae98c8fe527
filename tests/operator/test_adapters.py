"""InferenceModel LoRA adapters: spec.lora and spec.adapters parsed, validated (by
parse_spec and by the CRD's schema), rendered into engine flags, the adapters'
ConfigMap and the adapter-sync container, and reported in status. Pure code, except the
last two tests (marked ``cluster``): the API server's CEL rules, and the operator on the
real control plane changing the adapter list without touching the Deployment."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from importlib import resources
from typing import Any

import pytest
import yaml
from kubernetes.client import ApiClient

from kvserve.cli import build_parser
from kvserve.server.main import add_arguments, lora_problem
from kvserve_operator.render import (
    ADAPTER_SYNC_CONTAINER,
    ADAPTERS_CONFIG_DIR,
    ADAPTERS_CONFIG_KEY,
    HTTP_PORT,
    LORA_DIR,
    OperatorSettings,
    owner_reference,
    render_children,
)
from kvserve_operator.spec import (
    ADAPTER_NAME_PATTERN,
    LORA_FLAGS,
    MAX_ADAPTERS,
    OPERATOR_OWNED_FLAGS,
    AdapterSpec,
    InferenceModelSpec,
    LoraSpec,
    SpecError,
    parse_spec,
)
from kvserve_operator.status import adapters_status
from tests.cluster.controlplane import Cluster
from tests.support.inference_models import inference_model
from tests.support.operator_process import OperatorProcess, install_operator_rbac
from tests.support.waiting import poll

NAME = "llama"
NAMESPACE = "models"
UID = "0b6c2c1e-5f37-4d5e-9d7c-2f1f4c7a9e10"
SETTINGS = OperatorSettings()
HF = "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f249a16976918f6564b8830bc894c89659"
COMMIT = "a" * 40
SQL = {"name": "sql", "source": "hf://acme/sql-lora", "revision": COMMIT}
SUPPORT = {"name": "support", "source": "file:///opt/adapters/support"}


def spec(**fields: Any) -> InferenceModelSpec:
    raw: dict[str, Any] = {"model": {"source": HF}}
    raw.update(fields)
    return parse_spec(raw)


def children(s: InferenceModelSpec, name: str = NAME) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in render_children(name, NAMESPACE, UID, s, SETTINGS, 2)}


def containers(s: InferenceModelSpec) -> dict[str, dict[str, Any]]:
    pod = children(s)["Deployment"]["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def volumes(s: InferenceModelSpec) -> dict[str, dict[str, Any]]:
    pod = children(s)["Deployment"]["spec"]["template"]["spec"]
    return {v["name"]: v for v in pod["volumes"]}


# ---- parsing ----------------------------------------------------------------------------


def test_parse_lora_and_adapters() -> None:
    s = spec(lora={"maxLoras": 4, "maxRank": 64, "maxCpuLoras": 8}, adapters=[SQL, SUPPORT])
    assert s.lora == LoraSpec(max_loras=4, max_rank=64, max_cpu_loras=8)
    assert s.adapters == (
        AdapterSpec("sql", "hf://acme/sql-lora", COMMIT),
        AdapterSpec("support", "file:///opt/adapters/support"),
    )
    assert s.adapters[0].resolved_source == f"hf://acme/sql-lora@{COMMIT}"
    assert s.adapters[0].parsed_source.revision == COMMIT
    assert s.lora_enabled


def test_lora_is_off_unless_asked_for() -> None:
    assert not spec().lora_enabled
    assert not spec(adapters=[]).lora_enabled
    assert spec(lora={}).lora_enabled
    assert spec(adapters=[SUPPORT]).lora_enabled
    # Adapters alone serve with the engine's default limits.
    assert spec(adapters=[SUPPORT]).lora_limits == LoraSpec(max_loras=1, max_rank=16)


def test_pvc_adapter_on_the_models_claim_is_accepted() -> None:
    s = spec(
        model={"source": "pvc://models/llama"},
        adapters=[{"name": "a", "source": "pvc://models/adapters/a"}],
    )
    assert s.adapters[0].parsed_source.claim == "models"


@pytest.mark.parametrize(
    ("adapters", "path", "fragment"),
    [
        ([{"name": "SQL", "source": "file:///a"}], "adapters[0].name", "DNS-1123"),
        ([{"name": "sql_v2", "source": "file:///a"}], "adapters[0].name", "DNS-1123"),
        ([{"name": "-a", "source": "file:///a"}], "adapters[0].name", "DNS-1123"),
        ([{"name": "a" * 64, "source": "file:///a"}], "adapters[0].name", "longer than 63"),
        ([{"source": "file:///a"}], "adapters[0].name", "required"),
        ([{"name": "a"}], "adapters[0].source", "required"),
        ([{"name": "a", "source": "s3://b/a"}], "adapters[0].source", "hf://"),
        (
            [{"name": "a", "source": "file:///a"}, {"name": "a", "source": "file:///b"}],
            "adapters[1].name",
            "duplicate adapter 'a'",
        ),
        (
            [{"name": "a", "source": "file:///a", "revision": "main"}],
            "adapters[0].revision",
            "only to an hf:// source",
        ),
        (
            [{"name": "a", "source": "hf://o/a@v1", "revision": "main"}],
            "adapters[0].revision",
            "without its own @revision",
        ),
        (
            [{"name": "a", "source": "pvc://other/a"}],
            "adapters[0].source",
            "a claim the engine pods already mount",
        ),
        ([{"name": "a", "source": "file:///a", "rank": 8}], "adapters[0].rank", "unknown field"),
        ([{"name": f"a{i}", "source": "file:///a"} for i in range(65)], "adapters", "at most 64"),
    ],
)
def test_invalid_adapters(adapters: list[dict[str, Any]], path: str, fragment: str) -> None:
    with pytest.raises(SpecError) as err:
        spec(adapters=adapters)
    assert err.value.path == f"spec.{path}"
    assert fragment in err.value.message


@pytest.mark.parametrize(
    ("lora", "path"),
    [
        ({"maxLoras": 0}, "lora.maxLoras"),
        ({"maxRank": 0}, "lora.maxRank"),
        ({"maxCpuLoras": -1}, "lora.maxCpuLoras"),
        ({"maxLora": 2}, "lora.maxLora"),
    ],
)
def test_invalid_lora_limits(lora: dict[str, Any], path: str) -> None:
    with pytest.raises(SpecError) as err:
        spec(lora=lora)
    assert err.value.path == f"spec.{path}"


@pytest.mark.parametrize("flag", LORA_FLAGS)
def test_extra_args_may_not_set_lora_flags(flag: str) -> None:
    assert flag in OPERATOR_OWNED_FLAGS
    for arg in (flag, f"{flag}=4"):
        with pytest.raises(SpecError) as err:
            spec(engine={"extraArgs": ["--seed=1", arg]})
        assert err.value.path == "spec.engine.extraArgs[1]"
        assert "set by the operator" in err.value.message


@pytest.mark.parametrize("flag", OPERATOR_OWNED_FLAGS)
def test_no_prefix_of_an_owned_flag_reaches_the_engine(flag: str) -> None:
    """The operator refuses an owned flag in extraArgs by exact match; a prefix of one
    (`--served` for `--served-model-name`) is not refused there, so `kvserve serve` must
    refuse it: it once took it as the flag (argparse's abbreviations)."""
    from kvserve.cli import build_parser

    parser = build_parser(["serve"])
    for prefix in (flag[:-1], flag[: max(4, len(flag) // 2)]):
        extra = list(spec(engine={"extraArgs": [f"{prefix}=1"]}).engine.extra_args)
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--model", "/models/m", *extra])


def test_an_adapter_may_not_take_the_served_name() -> None:
    # The served name defaults to the resource's name...
    with pytest.raises(SpecError) as err:
        children(spec(adapters=[{"name": NAME, "source": "file:///a"}]))
    assert err.value.path == "spec.adapters[0].name"
    assert "served name" in err.value.message
    # ... or is spec.model.servedName, which frees the resource's name for an adapter.
    named = spec(
        model={"source": HF, "servedName": "base"},
        adapters=[{"name": NAME, "source": "file:///a"}],
    )
    assert "ConfigMap" in children(named)
    with pytest.raises(SpecError):
        children(
            spec(
                model={"source": HF, "servedName": "base"},
                adapters=[{"name": "base", "source": "file:///a"}],
            )
        )


@pytest.mark.parametrize(
    "path",
    ["/models/a", "/tmp/a", "/mnt/pvc/c/a", "/adapters/a", "/etc/kvserve/adapters/a",
     "/opt/../adapters/a", "/adapters"],
)  # fmt: skip
def test_a_file_adapter_hidden_by_a_volume_is_refused(path: str) -> None:
    """The adapter-sync container mounts volumes at these folders: an adapter baked into
    the image there could never be read (it would show as not loaded, with no reason)."""
    with pytest.raises(SpecError) as err:
        children(spec(adapters=[SUPPORT, {"name": "other", "source": f"file://{path}"}]))
    assert err.value.path == "spec.adapters[1].source"
    assert "hidden by the pod's" in err.value.message
    assert "ConfigMap" in children(spec(adapters=[SUPPORT]))  # /opt/adapters/support is read


# ---- rendering --------------------------------------------------------------------------


def test_without_lora_nothing_changes() -> None:
    s = spec()
    assert list(children(s)) == ["Deployment", "Service", "PodDisruptionBudget"]
    assert list(containers(s)) == ["engine"]
    assert not set(LORA_FLAGS) & set(containers(s)["engine"]["args"])
    assert {"adapters", "adapters-config"}.isdisjoint(volumes(s))


def test_lora_flags_volume_and_mount() -> None:
    s = spec(lora={"maxLoras": 4, "maxRank": 64, "maxCpuLoras": 8}, adapters=[SQL])
    engine = containers(s)["engine"]
    args = engine["args"]
    start = args.index("--enable-lora")
    assert args[start:] == [
        "--enable-lora",
        "--max-loras",
        "4",
        "--max-lora-rank",
        "64",
        "--max-cpu-loras",
        "8",
        "--lora-dir",
        LORA_DIR,
    ]
    assert {"name": "adapters", "mountPath": LORA_DIR, "readOnly": True} in engine["volumeMounts"]
    assert volumes(s)["adapters"] == {"name": "adapters", "emptyDir": {}}
    assert volumes(s)["adapters-config"] == {
        "name": "adapters-config",
        "configMap": {"name": f"{NAME}-adapters"},
    }
    # No --max-cpu-loras without maxCpuLoras: the engine's default applies.
    assert "--max-cpu-loras" not in containers(spec(adapters=[SQL]))["engine"]["args"]


def test_lora_args_are_accepted_by_kvserve_serve() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    s = spec(lora={"maxLoras": 2, "maxRank": 8, "maxCpuLoras": 3}, adapters=[SQL])
    args = parser.parse_args(containers(s)["engine"]["args"])
    assert args.enable_lora is True
    assert (args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (2, 8, 3)
    assert args.lora_dir == LORA_DIR and args.lora_modules == []
    assert lora_problem(args) is None


def test_adapters_config_map() -> None:
    s = spec(lora={}, adapters=[SUPPORT, SQL])
    rendered = render_children(NAME, NAMESPACE, UID, s, SETTINGS, 1)
    # First: the pods mount it, so it exists before they are created.
    config_map = rendered[0]
    assert config_map["kind"] == "ConfigMap"
    meta = config_map["metadata"]
    assert (meta["name"], meta["namespace"]) == (f"{NAME}-adapters", NAMESPACE)
    assert meta["ownerReferences"] == [owner_reference(NAME, UID)]
    assert json.loads(config_map["data"][ADAPTERS_CONFIG_KEY]) == {
        "adapters": [
            {"name": "support", "source": "file:///opt/adapters/support"},
            {"name": "sql", "source": f"hf://acme/sql-lora@{COMMIT}"},
        ]
    }
    empty = children(spec(lora={}))["ConfigMap"]
    assert json.loads(empty["data"][ADAPTERS_CONFIG_KEY]) == {"adapters": []}


def test_adapter_sync_container() -> None:
    s = spec(
        model={"source": "pvc://models/llama", "hfTokenSecret": {"name": "hf"}},
        adapters=[{"name": "a", "source": "pvc://models/adapters/a"}],
        image="img:1",
        imagePullPolicy="Always",
    )
    sidecar = containers(s)[ADAPTER_SYNC_CONTAINER]
    assert (sidecar["image"], sidecar["imagePullPolicy"]) == ("img:1", "Always")
    config = f"{ADAPTERS_CONFIG_DIR}/{ADAPTERS_CONFIG_KEY}"
    assert sidecar["command"] == [
        "kvserve",
        "adapters",
        "sync",
        "--config",
        config,
        "--lora-dir",
        LORA_DIR,
        "--url",
        f"http://127.0.0.1:{HTTP_PORT}",
    ]
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    assert mounts["adapters"] == {"name": "adapters", "mountPath": LORA_DIR}
    assert mounts["adapters-config"]["readOnly"] is True
    assert mounts["model-pvc"]["mountPath"] == "/mnt/pvc/models"  # pvc:// adapters
    assert {"tmp", "model-cache"} <= set(mounts)
    env = {v["name"]: v for v in sidecar["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf"
    assert "HF_TOKEN" not in {v["name"] for v in containers(s)["engine"]["env"]}
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    # The command is one `kvserve` parses.
    parsed = build_parser(sidecar["command"][1:]).parse_args(sidecar["command"][1:])
    assert str(parsed.config) == config and str(parsed.lora_dir) == LORA_DIR


@pytest.mark.parametrize(
    "adapters",
    [
        [],
        [SQL],
        [SUPPORT, SQL],
        [{**SQL, "revision": "b" * 40}],
        [{"name": f"a{i}", "source": f"file:///opt/a{i}"} for i in range(MAX_ADAPTERS)],
    ],
)
def test_changing_adapters_changes_only_the_config_map(adapters: list[dict[str, Any]]) -> None:
    """The invariant that spares restarts: the pod template never depends on the list."""
    lora = {"maxLoras": 2}
    before = children(spec(lora=lora, adapters=[SUPPORT]))
    after = children(spec(lora=lora, adapters=adapters))
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        assert after[kind] == before[kind], kind
    assert (after["ConfigMap"] == before["ConfigMap"]) == (adapters == [SUPPORT])


def test_adapters_without_spec_lora_render_like_default_limits() -> None:
    # So adding spec.lora: {} beside a list does not roll the pods either.
    with_list = children(spec(adapters=[SQL]))["Deployment"]
    assert with_list == children(spec(lora={}, adapters=[SUPPORT]))["Deployment"]


KUBERNETES_MODELS = {
    "Deployment": "V1Deployment",
    "Service": "V1Service",
    "PodDisruptionBudget": "V1PodDisruptionBudget",
    "ConfigMap": "V1ConfigMap",
}


def test_children_with_adapters_survive_the_kubernetes_models() -> None:
    """A misspelt field would be dropped by the typed model, so the round trip differs."""
    s = spec(
        model={"source": HF, "hfTokenSecret": {"name": "hf"}},
        lora={"maxLoras": 2, "maxCpuLoras": 1},
        adapters=[SQL, SUPPORT],
    )
    client = ApiClient()
    try:
        for kind, child in children(s).items():
            model = client._ApiClient__deserialize(child, KUBERNETES_MODELS[kind])  # type: ignore[attr-defined]
            assert client.sanitize_for_serialization(model) == child, kind
    finally:
        client.close()


# ---- status -----------------------------------------------------------------------------


def test_status_lists_adapters_and_counts_replicas_that_serve_them() -> None:
    assert adapters_status(spec(), []) is None
    assert adapters_status(spec(lora={}), [frozenset({"x"})]) is None
    served = [frozenset({"sql", "other"}), frozenset({"sql"}), frozenset()]
    assert adapters_status(spec(adapters=[SQL, SUPPORT]), served) == [
        {"name": "sql", "source": f"hf://acme/sql-lora@{COMMIT}", "loadedReplicas": 2},
        {"name": "support", "source": "file:///opt/adapters/support", "loadedReplicas": 0},
    ]


# ---- the CRD ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    text = resources.files("kvserve_operator").joinpath("manifests", "crd.yaml").read_text()
    out: dict[str, Any] = yaml.safe_load(text)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return out


def test_crd_adapters_schema_matches_spec_py(schema: dict[str, Any]) -> None:
    spec_props = schema["properties"]["spec"]["properties"]
    adapters = spec_props["adapters"]
    assert adapters["maxItems"] == MAX_ADAPTERS
    assert adapters["default"] == []
    # Keyed by name: the API server refuses two adapters with one name.
    assert adapters["x-kubernetes-list-type"] == "map"
    assert adapters["x-kubernetes-list-map-keys"] == ["name"]
    item = adapters["items"]
    assert set(item["required"]) == {"name", "source"}
    name = item["properties"]["name"]
    assert name["pattern"] == ADAPTER_NAME_PATTERN and name["maxLength"] == 63
    # The same source rule as the model's.
    assert (
        item["properties"]["source"]["x-kubernetes-validations"][0]["rule"]
        == spec_props["model"]["properties"]["source"]["x-kubernetes-validations"][0]["rule"]
    )
    assert "self.source.startsWith('hf://')" in item["x-kubernetes-validations"][0]["rule"]
    lora = spec_props["lora"]
    assert "default" not in lora  # absent = LoRA off
    assert set(lora["properties"]) == {"maxLoras", "maxRank", "maxCpuLoras"}


def test_crd_refuses_an_adapter_named_like_the_base_model(schema: dict[str, Any]) -> None:
    rules = [r["rule"] for r in schema["x-kubernetes-validations"]]
    (rule,) = [r for r in rules if "adapters" in r]
    assert "self.spec.model.servedName" in rule and "self.metadata.name" in rule


def test_crd_adapter_name_pattern_agrees_with_parse_spec() -> None:
    for ok in ("a", "sql", "sql-v2", "0day", "a" * 63):
        assert re.fullmatch(ADAPTER_NAME_PATTERN, ok), ok
        spec(adapters=[{"name": ok, "source": "file:///a"}])
    for bad in ("SQL", "sql_v2", "-a", "a-", "a.b", ""):
        assert not re.fullmatch(ADAPTER_NAME_PATTERN, bad), bad
        with pytest.raises(SpecError):
            spec(adapters=[{"name": bad, "source": "file:///a"}])


# ---- on the real control plane ----------------------------------------------------------


def _apply(cluster: Cluster, obj: dict[str, Any], *flags: str) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("apply", *flags, "-f", "-", input=json.dumps(obj), check=False)


def _get(cluster: Cluster, kind: str, ns: str, name: str) -> dict[str, Any] | None:
    proc = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    if proc.returncode != 0:
        assert "NotFound" in proc.stderr, proc.stderr
        return None
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


@pytest.mark.cluster
@pytest.mark.slow
def test_the_api_server_enforces_the_adapter_rules(k8s_cluster: Cluster) -> None:
    install_operator_rbac(k8s_cluster)  # installs the CRD
    ns = "adapter-rules"
    k8s_cluster.kubectl("create", "namespace", ns, check=False)
    ok = inference_model("ok", ns, lora={"maxLoras": 2}, adapters=[SQL, SUPPORT])
    accepted = _apply(k8s_cluster, ok, "--dry-run=server")
    assert accepted.returncode == 0, accepted.stderr
    cases: list[tuple[dict[str, Any], str]] = [
        ({"adapters": [{"name": "SQL", "source": "file:///a"}]}, "should match"),
        ({"adapters": [{"name": "a", "source": "s3://b/a"}]}, "adapters[].source must be"),
        (
            {
                "adapters": [
                    {"name": "a", "source": "file:///a"},
                    {"name": "a", "source": "file:///b"},
                ]
            },
            "Duplicate value",
        ),
        (
            {"adapters": [{"name": "a", "source": "file:///a", "revision": "v1"}]},
            "revision applies only",
        ),
        ({"adapters": [{"name": "tiny", "source": "file:///a"}]}, "base model's served name"),
        ({"lora": {"maxLoras": 0}}, "maxLoras"),
        ({"engine": {"extraArgs": ["--lora-dir=/x"]}}, "LoRA flags"),
    ]
    for fields, fragment in cases:
        proc = _apply(k8s_cluster, inference_model("bad", ns, **fields), "--dry-run=server")
        assert proc.returncode != 0, f"{fields} was accepted"
        assert fragment in proc.stderr, (fields, proc.stderr)
    # Without servedName the served name is metadata.name.
    unnamed = inference_model("solo", ns, adapters=[{"name": "solo", "source": "file:///a"}])
    del unnamed["spec"]["model"]["servedName"]
    proc = _apply(k8s_cluster, unnamed, "--dry-run=server")
    assert proc.returncode != 0 and "base model's served name" in proc.stderr, proc.stderr


@pytest.mark.cluster
@pytest.mark.slow
def test_operator_changes_adapters_without_a_rollout(
    k8s_cluster: Cluster, operator: OperatorProcess
) -> None:
    ns = "adapter-rollout"
    k8s_cluster.kubectl("create", "namespace", ns, check=False)
    proc = _apply(k8s_cluster, inference_model("llm", ns, lora={"maxLoras": 2}, adapters=[SQL]))
    assert proc.returncode == 0, proc.stderr

    def config_map_lists(names: list[str]) -> bool:
        cm = _get(k8s_cluster, "configmap", ns, "llm-adapters")
        data = json.loads(((cm or {}).get("data") or {}).get(ADAPTERS_CONFIG_KEY) or "{}")
        return [a["name"] for a in data.get("adapters", [])] == names

    poll("the adapters ConfigMap", lambda: config_map_lists(["sql"]))
    deployment = poll("the Deployment", lambda: _get(k8s_cluster, "deployment", ns, "llm"))
    template = deployment["spec"]["template"]
    names = [c["name"] for c in template["spec"]["containers"]]
    assert names == ["engine", ADAPTER_SYNC_CONTAINER]
    generation = deployment["metadata"]["generation"]

    k8s_cluster.kubectl(
        "patch", "im", "llm", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"adapters": [SUPPORT, SQL]}}),
    )  # fmt: skip
    poll("the new list in the ConfigMap", lambda: config_map_lists(["support", "sql"]))

    def status_lists_both() -> bool:
        im = _get(k8s_cluster, "inferencemodel", ns, "llm") or {}
        listed = [a["name"] for a in (im.get("status") or {}).get("adapters") or []]
        return listed == ["support", "sql"]

    poll("status.adapters", status_lists_both)
    im = _get(k8s_cluster, "inferencemodel", ns, "llm")
    assert im is not None
    # kwok's pods run no engine, so none answers /v1/models: counted as not loaded.
    assert [a["loadedReplicas"] for a in im["status"]["adapters"]] == [0, 0]
    after = _get(k8s_cluster, "deployment", ns, "llm")
    assert after is not None
    assert after["metadata"]["generation"] == generation  # no new template: no rollout
    assert after["spec"]["template"] == template
