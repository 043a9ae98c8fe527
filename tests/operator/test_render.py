"""The pure renderers (spec → Deployment, Service, PDB) and status.capacity."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client import ApiClient

from kvserve.model.config import ModelConfig
from kvserve.parallel.shard import rank_num_params
from kvserve_operator.capacity import capacity_status
from kvserve_operator.config import OperatorConfig
from kvserve_operator.kube import Kube
from kvserve_operator.reconcile import Reconciler
from kvserve_operator.render import (
    GRPC_PORT,
    HTTP_PORT,
    METRICS_PORT,
    OperatorSettings,
    child_labels,
    desired_replicas,
    endpoint_status,
    engine_args,
    model_dir,
    owner_reference,
    render_children,
    render_deployment,
    render_pdb,
    render_service,
    selector_labels,
    selector_string,
)
from kvserve_operator.spec import InferenceModelSpec, SpecError, parse_spec

NAME = "llama"
NAMESPACE = "models"
UID = "0b6c2c1e-5f37-4d5e-9d7c-2f1f4c7a9e10"
SETTINGS = OperatorSettings()
HF = "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f249a16976918f6564b8830bc894c89659"


def spec(**fields: Any) -> InferenceModelSpec:
    raw: dict[str, Any] = {"model": {"source": HF}}
    raw.update(fields)
    return parse_spec(raw)


def deployment(s: InferenceModelSpec, replicas: int = 1, name: str = NAME) -> dict[str, Any]:
    return render_deployment(name, NAMESPACE, UID, s, SETTINGS, replicas)


def pod(s: InferenceModelSpec) -> dict[str, Any]:
    out: dict[str, Any] = deployment(s)["spec"]["template"]["spec"]
    return out


def engine(s: InferenceModelSpec) -> dict[str, Any]:
    (container,) = pod(s)["containers"]
    assert container["name"] == "engine"
    out: dict[str, Any] = container
    return out


def init(s: InferenceModelSpec) -> dict[str, Any]:
    (container,) = pod(s)["initContainers"]
    assert container["name"] == "model-pull"
    out: dict[str, Any] = container
    return out


def env_names(container: dict[str, Any]) -> list[str]:
    return [e["name"] for e in container.get("env", [])]


DEFAULT_ARGS = [
    "--model",
    "/models/meta-llama--Llama-3.1-8B-Instruct",
    "--served-model-name",
    NAME,
    "--host",
    "0.0.0.0",
    "--port",
    "8000",
    "--grpc-port",
    "50051",
    "--device",
    "cuda",
    "--dtype",
    "auto",
    "--kv-cache-dtype",
    "auto",
    "--block-size",
    "16",
    "--max-num-seqs",
    "64",
    "--max-num-batched-tokens",
    "2048",
    "--gpu-memory-utilization",
    "0.9",
    # One GPU, one pod: one rank.
    "--tensor-parallel-size",
    "1",
    "--drain-timeout",
    "30",
]


# ---- the minimal spec -------------------------------------------------------------------


def test_minimal_spec_renders_three_children_in_order() -> None:
    children = render_children(NAME, NAMESPACE, UID, spec(), SETTINGS, 1)
    assert [(c["apiVersion"], c["kind"]) for c in children] == [
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("policy/v1", "PodDisruptionBudget"),
    ]
    for child in children:
        meta = child["metadata"]
        assert meta["name"] == NAME
        assert meta["namespace"] == NAMESPACE
        assert meta["labels"] == child_labels(NAME)
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "kvserve.dev/v1alpha1",
                "kind": "InferenceModel",
                "name": NAME,
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["ownerReferences"] == [owner_reference(NAME, UID)]


def test_labels() -> None:
    assert selector_labels(NAME) == {
        "app.kubernetes.io/name": "kvserve-engine",
        "app.kubernetes.io/instance": NAME,
    }
    assert child_labels(NAME, spec()) == {
        "app.kubernetes.io/name": "kvserve-engine",
        "app.kubernetes.io/instance": NAME,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": "kvserve-operator",
        "kvserve.dev/inference-model": NAME,
    }
    assert selector_string(NAME) == (
        "app.kubernetes.io/name=kvserve-engine,app.kubernetes.io/instance=llama"
    )


def test_minimal_deployment() -> None:
    d = deployment(spec(), replicas=2)
    s = d["spec"]
    assert s["replicas"] == 2
    assert s["selector"] == {"matchLabels": selector_labels(NAME)}
    assert s["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    template = s["template"]
    assert template["metadata"]["labels"] == child_labels(NAME)
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
        "kvserve.dev/served-name": NAME,
    }
    p = template["spec"]
    assert p["terminationGracePeriodSeconds"] == 45
    assert p["enableServiceLinks"] is False
    assert p["automountServiceAccountToken"] is False
    assert p["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for absent in ("nodeSelector", "tolerations", "priorityClassName"):
        assert absent not in p
    assert p["volumes"] == [
        {"name": "model-cache", "emptyDir": {"sizeLimit": "100Gi"}},
        {"name": "tmp", "emptyDir": {}},
    ]


def test_minimal_engine_container() -> None:
    c = engine(spec())
    assert c["image"] == "ghcr.io/kvserve/kvserve:0.1.0"
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert c["command"] == ["kvserve", "serve"]
    assert c["args"] == DEFAULT_ARGS
    assert c["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
    ]
    assert c["env"] == [{"name": "HOME", "value": "/tmp"}]
    assert c["resources"] == {
        "requests": {"nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "1"},
    }
    http = {"path": "/ready", "port": "http"}
    assert c["startupProbe"] == {
        "httpGet": http,
        "periodSeconds": 10,
        "failureThreshold": 180,
        "timeoutSeconds": 5,
    }
    assert c["readinessProbe"] == {
        "httpGet": http,
        "periodSeconds": 5,
        "failureThreshold": 2,
        "timeoutSeconds": 5,
    }
    assert c["livenessProbe"] == {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": 10,
        "failureThreshold": 6,
        "timeoutSeconds": 5,
    }
    assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert c["volumeMounts"] == [
        {"name": "model-cache", "mountPath": "/models"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]


def test_minimal_init_container() -> None:
    c = init(spec())
    assert c["image"] == engine(spec())["image"]
    assert c["command"] == [
        "kvserve",
        "model",
        "pull",
        HF,
        "/models/meta-llama--Llama-3.1-8B-Instruct",
    ]
    assert c["env"] == [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/models/.hf-home"},
        {"name": "KVSERVE_PVC_ROOT", "value": "/mnt/pvc"},
    ]
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}
    assert c["volumeMounts"] == engine(spec())["volumeMounts"]


def test_security_context_on_every_container() -> None:
    for s in (spec(), spec(model={"source": "pvc://models/x"}), spec(resources={"gpus": 0})):
        p = pod(s)
        for c in p["initContainers"] + p["containers"]:
            assert c["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }, c["name"]
            # A read-only root needs writable HOME and /tmp.
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
            assert {"name": "HOME", "value": "/tmp"} in c["env"]


# ---- GPUs -------------------------------------------------------------------------------


def test_no_gpus_runs_on_cpu() -> None:
    c = engine(spec(resources={"gpus": 0}))
    assert "resources" not in c or c["resources"] == {}
    assert c["args"][c["args"].index("--device") + 1] == "cpu"


def test_four_gpus_with_custom_resource_name() -> None:
    c = engine(spec(resources={"gpus": 4, "gpuResourceName": "amd.com/gpu"}))
    assert c["resources"] == {"requests": {"amd.com/gpu": "4"}, "limits": {"amd.com/gpu": "4"}}
    assert c["args"][c["args"].index("--device") + 1] == "cuda"


@pytest.mark.parametrize(
    ("resources", "field"),
    [({"cpu": -1}, "cpu"), ({"memory": "-1Gi"}, "memory"), ({"cpu": "-500m"}, "cpu")],
)
def test_negative_quantities_are_refused(resources: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=rf"^spec\.resources\.{field}: "):
        spec(resources={"gpus": 1, **resources})


@pytest.mark.parametrize("target", [0.001, 1e-320])
def test_an_autoscaling_target_below_the_floor_is_refused(target: float) -> None:
    with pytest.raises(SpecError, match=r"^spec\.autoscaling\.target: must be at least 0\.01"):
        spec(autoscaling={"enabled": True, "maxReplicas": 2, "target": target})


def test_cpu_and_memory() -> None:
    c = engine(spec(resources={"gpus": 1, "cpu": 8, "memory": "64Gi"}))
    assert c["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"},
        # Memory is also the limit; CPU has none (throttling stalls decode steps).
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "1"},
    }


@pytest.mark.parametrize(
    ("cpu", "threads"), [("2500m", "2"), (4, "4"), ("500m", "1"), ("1.5", "1")]
)
def test_a_cpu_engine_computes_with_as_many_threads_as_its_cpu_request(
    cpu: object, threads: str
) -> None:
    """PyTorch would start a thread per CPU of the node, and with the node busy every op
    would wait for threads that are not running."""
    c = engine(spec(resources={"gpus": 0, "cpu": cpu}))
    assert {"name": "OMP_NUM_THREADS", "value": threads} in c["env"]
    assert env_names(c).count("OMP_NUM_THREADS") == 1


def test_no_thread_count_without_a_cpu_request_on_a_gpu_or_when_env_sets_it() -> None:
    for s in (
        spec(resources={"gpus": 0}),
        spec(resources={"gpus": 1, "cpu": 8}),
    ):
        assert "OMP_NUM_THREADS" not in env_names(engine(s))
    mine = {"name": "OMP_NUM_THREADS", "value": "3"}
    c = engine(spec(resources={"gpus": 0, "cpu": 8}, env=[mine]))
    assert [e for e in c["env"] if e["name"] == "OMP_NUM_THREADS"] == [mine]


# ---- model sources ----------------------------------------------------------------------


def test_pvc_source_mounts_the_claim_read_only_in_both_containers() -> None:
    s = spec(model={"source": "pvc://model-store/llama/8b-instruct"})
    dest = "/mnt/pvc/model-store/llama/8b-instruct"
    assert model_dir(s) == dest
    p = pod(s)
    assert {
        "name": "model-pvc",
        "persistentVolumeClaim": {"claimName": "model-store", "readOnly": True},
    } in p["volumes"]
    mount = {"name": "model-pvc", "mountPath": "/mnt/pvc/model-store", "readOnly": True}
    for c in p["initContainers"] + p["containers"]:
        assert mount in c["volumeMounts"], c["name"]
    # DEST is the source's own path: the pull only verifies it in place.
    assert init(s)["command"] == [
        "kvserve",
        "model",
        "pull",
        "pvc://model-store/llama/8b-instruct",
        dest,
    ]
    assert {"name": "KVSERVE_PVC_ROOT", "value": "/mnt/pvc"} in init(s)["env"]
    assert engine(s)["args"][:2] == ["--model", dest]


def test_pvc_source_without_path_uses_the_claim_root() -> None:
    s = spec(model={"source": "pvc://models"})
    assert model_dir(s) == "/mnt/pvc/models"
    assert init(s)["command"][-1] == "/mnt/pvc/models"


def test_file_source() -> None:
    s = spec(model={"source": "file:///opt/models/qwen3"})
    assert model_dir(s) == "/opt/models/qwen3"
    assert init(s)["command"][-2:] == ["file:///opt/models/qwen3", "/opt/models/qwen3"]
    assert engine(s)["args"][:2] == ["--model", "/opt/models/qwen3"]
    assert [v["name"] for v in pod(s)["volumes"]] == ["model-cache", "tmp"]


@pytest.mark.parametrize(
    "path", ["/models/x", "/tmp/m", "/mnt/pvc/c/m", "/models", "/opt/../models/x", "/tmp/./m"]
)
def test_file_source_hidden_by_a_volume_is_refused(path: str) -> None:
    s = spec(model={"source": f"file://{path}"})
    with pytest.raises(SpecError, match=r"^spec\.model\.source: .*hidden"):
        render_children(NAME, NAMESPACE, UID, s, SETTINGS, 1)


def test_with_lora_a_file_model_under_the_adapters_volume_is_refused() -> None:
    """The engine mounts the adapters' volume at /adapters when LoRA is on."""
    s = spec(model={"source": "file:///adapters/base"}, lora={})
    with pytest.raises(SpecError, match=r"^spec\.model\.source: .*hidden by the pod's /adapters"):
        render_children(NAME, NAMESPACE, UID, s, SETTINGS, 1)
    assert model_dir(spec(model={"source": "file:///adapters/base"})) == "/adapters/base"


def test_hf_source_with_revision_and_token_secret() -> None:
    s = spec(model={"source": HF, "hfTokenSecret": {"name": "hf-token"}})
    token = {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}},
    }
    assert token in init(s)["env"]
    # The engine never downloads, so it never sees the token.
    assert "HF_TOKEN" not in env_names(engine(s))
    assert init(s)["command"][3] == HF  # the revision is passed through as written

    s = spec(model={"source": "hf://org/private", "hfTokenSecret": {"name": "s", "key": "tok"}})
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "s", "key": "tok"}},
    } in init(s)["env"]
    assert model_dir(s) == "/models/org--private"


# ---- engine settings --------------------------------------------------------------------


def test_engine_overrides_give_exact_args() -> None:
    s = spec(
        model={"source": "hf://Qwen/Qwen3-8B", "servedName": "qwen3"},
        resources={"gpus": 1},
        engine={
            "dtype": "bfloat16",
            "quantization": "int8",
            "kvCacheDtype": "fp8_e4m3",
            "maxModelLen": 8192,
            "maxNumSeqs": 256,
            "maxNumBatchedTokens": 8192,
            "blockSize": 32,
            "kvCacheMemoryFraction": 0.85,
            "enablePrefixCaching": False,
            "drainTimeoutSeconds": 120,
            "extraArgs": ["--seed", "7", "--log-level=debug"],
        },
    )
    assert engine(s)["args"] == [
        "--model",
        "/models/Qwen--Qwen3-8B",
        "--served-model-name",
        "qwen3",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--grpc-port",
        "50051",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--quantization",
        "int8",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--block-size",
        "32",
        "--max-num-seqs",
        "256",
        "--max-num-batched-tokens",
        "8192",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.85",
        "--no-prefix-caching",
        "--tensor-parallel-size",
        "1",
        "--drain-timeout",
        "120",
        "--seed",
        "7",
        "--log-level=debug",
    ]
    assert engine_args(s, "/m", "n")[:4] == ["--model", "/m", "--served-model-name", "n"]
    assert pod(s)["terminationGracePeriodSeconds"] == 135


def test_engine_args_are_accepted_by_kvserve_serve() -> None:
    """The flags exist in `kvserve serve` (parsed by its own argparse definition)."""
    import argparse

    from kvserve.server.main import add_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    s = spec(engine={"maxModelLen": 4096, "enablePrefixCaching": False, "dtype": "float16"})
    args = parser.parse_args(engine(s)["args"])
    assert args.port == HTTP_PORT and args.grpc_port == GRPC_PORT
    assert args.max_model_len == 4096 and args.enable_prefix_caching is False
    assert args.gpu_memory_utilization == 0.9 and args.drain_timeout == 30
    assert args.served_model_name == NAME


def test_served_name_annotations() -> None:
    s = spec(model={"source": HF, "servedName": "llama-3.1-8b-instruct"})
    d = deployment(s)
    assert d["spec"]["template"]["metadata"]["annotations"]["kvserve.dev/served-name"] == (
        "llama-3.1-8b-instruct"
    )
    svc = render_service(NAME, NAMESPACE, UID, s)
    assert svc["metadata"]["annotations"] == {"kvserve.dev/served-name": "llama-3.1-8b-instruct"}
    assert "--served-model-name" in engine(s)["args"]
    assert engine(s)["args"][3] == "llama-3.1-8b-instruct"


def test_env_image_and_pull_policy() -> None:
    s = spec(
        image="registry.example/kvserve:dev",
        imagePullPolicy="Always",
        env=[
            {"name": "KVSERVE_X", "value": "1"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
    )
    for c in (engine(s), init(s)):
        assert c["image"] == "registry.example/kvserve:dev"
        assert c["imagePullPolicy"] == "Always"
    assert engine(s)["env"] == [
        {"name": "HOME", "value": "/tmp"},
        {"name": "KVSERVE_X", "value": "1"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    assert "KVSERVE_X" not in env_names(init(s))
    # A user HOME replaces ours (no duplicate names: server-side apply rejects them).
    s = spec(env=[{"name": "HOME", "value": "/cache"}])
    assert engine(s)["env"] == [{"name": "HOME", "value": "/cache"}]


def test_operator_settings() -> None:
    settings = OperatorSettings(
        engine_image="my/kvserve:1", image_pull_policy="Never", cluster_domain="corp.internal"
    )
    d = render_deployment(NAME, NAMESPACE, UID, spec(), settings, 1)
    (c,) = d["spec"]["template"]["spec"]["containers"]
    assert (c["image"], c["imagePullPolicy"]) == ("my/kvserve:1", "Never")
    assert endpoint_status(NAME, NAMESPACE, settings)["host"] == "llama.models.svc.corp.internal"


def test_model_cache() -> None:
    p = pod(spec(modelCache={"sizeLimit": "400Gi", "medium": "Memory"}))
    assert p["volumes"][0] == {
        "name": "model-cache",
        "emptyDir": {"sizeLimit": "400Gi", "medium": "Memory"},
    }
    p = pod(spec(modelCache={"sizeLimit": 10**12}))
    assert p["volumes"][0] == {"name": "model-cache", "emptyDir": {"sizeLimit": "1000000000000"}}


def test_placement_passthrough() -> None:
    tolerations = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "pool", "operator": "Equal", "value": "h100", "tolerationSeconds": 60},
    ]
    p = pod(
        spec(
            resources={
                "nodeSelector": {"gpu.nvidia.com/class": "H100"},
                "tolerations": tolerations,
                "priorityClassName": "inference-high",
            }
        )
    )
    assert p["nodeSelector"] == {"gpu.nvidia.com/class": "H100"}
    assert p["tolerations"] == tolerations
    assert p["priorityClassName"] == "inference-high"


# ---- replicas ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("autoscaling", "replicas", "decision", "expected"),
    [
        (None, 3, None, 3),
        (None, 3, 7, 3),  # autoscaling off: the autoscaler's number is ignored
        (None, 0, None, 0),
        ({"enabled": False, "minReplicas": 2, "maxReplicas": 4}, 1, 3, 1),
        ({"enabled": True, "minReplicas": 2, "maxReplicas": 6}, 1, None, 2),
        ({"enabled": True, "minReplicas": 2, "maxReplicas": 6}, 1, 4, 4),
        ({"enabled": True, "minReplicas": 2, "maxReplicas": 6}, 1, 0, 2),
        ({"enabled": True, "minReplicas": 2, "maxReplicas": 6}, 1, 60, 6),
        ({"enabled": True, "minReplicas": 0, "maxReplicas": 6}, 5, 0, 0),
        ({"enabled": True, "minReplicas": 0, "maxReplicas": 6}, 5, None, 0),
        ({"enabled": True, "maxReplicas": 3}, 9, None, 1),  # default minReplicas 1
    ],
)
def test_desired_replicas(
    autoscaling: dict[str, Any] | None, replicas: int, decision: int | None, expected: int
) -> None:
    fields: dict[str, Any] = {"replicas": replicas}
    if autoscaling is not None:
        fields["autoscaling"] = autoscaling
    assert desired_replicas(spec(**fields), decision) == expected


def test_without_a_gateway_an_autoscaled_model_never_starts_or_stays_at_zero() -> None:
    """The reconciler's floor is 1 when it has no gateway to read: nothing else could say
    that requests wait for a replica, so a model rendered at zero stayed there."""
    zero = spec(autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 6})
    assert desired_replicas(zero, None, floor=1) == 1
    assert desired_replicas(zero, 0, floor=1) == 1
    assert desired_replicas(zero, 4, floor=1) == 4
    assert desired_replicas(spec(replicas=0), None, floor=1) == 0  # not autoscaled: as set
    without = Reconciler(Kube(ApiClient(), "test"), OperatorConfig())
    with_gateway = OperatorConfig(gateway_selector="app=gw", gateway_namespace="kvserve")
    assert without.replica_floor() == 1
    assert Reconciler(Kube(ApiClient(), "test"), with_gateway).replica_floor() == 0


# ---- Service, PDB, endpoint -------------------------------------------------------------


def test_service() -> None:
    svc = render_service(NAME, NAMESPACE, UID, spec())
    assert svc["metadata"]["labels"]["kvserve.dev/inference-model"] == NAME
    assert svc["metadata"]["annotations"] == {"kvserve.dev/served-name": NAME}
    assert svc["spec"] == {
        "type": "ClusterIP",
        "selector": selector_labels(NAME),
        "ports": [
            {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"},
            {
                "name": "grpc",
                "port": 50051,
                "targetPort": "grpc",
                "protocol": "TCP",
                "appProtocol": "grpc",
            },
            {"name": "metrics", "port": 9090, "targetPort": "http", "protocol": "TCP"},
        ],
    }
    # Every targetPort names a port of the engine container.
    port_names = {p["name"] for p in engine(spec())["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names


def test_pdb() -> None:
    pdb = render_pdb(NAME, NAMESPACE, UID, spec())
    assert pdb["spec"] == {
        "selector": {"matchLabels": selector_labels(NAME)},
        "maxUnavailable": 1,
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }


def test_endpoint_status() -> None:
    assert endpoint_status(NAME, NAMESPACE, SETTINGS) == {
        "service": NAME,
        "host": "llama.models.svc.cluster.local",
        "httpPort": HTTP_PORT,
        "grpcPort": GRPC_PORT,
        "metricsPort": METRICS_PORT,
        "url": "http://llama.models.svc.cluster.local:8000",
    }


@pytest.mark.parametrize("name", ["Llama", "a" * 53, "8b", "llama.8b", ""])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(SpecError, match=r"^metadata\.name: "):
        render_children(name, NAMESPACE, UID, spec(), SETTINGS, 1)


def test_longest_name_is_accepted() -> None:
    render_children("a" * 52, NAMESPACE, UID, spec(), SETTINGS, 1)


# ---- purity and validity ----------------------------------------------------------------

SPECS: dict[str, dict[str, Any]] = {
    "minimal": {"model": {"source": HF}},
    "cpu": {"model": {"source": "file:///opt/m"}, "resources": {"gpus": 0}},
    "pvc-4gpu": {
        "model": {"source": "pvc://store/llama-70b", "servedName": "llama-70b"},
        "resources": {
            "gpus": 4,
            "cpu": "32",
            "memory": "512Gi",
            "nodeSelector": {"a": "b"},
            "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "p",
        },
        "engine": {"maxModelLen": 8192, "enablePrefixCaching": False, "extraArgs": ["--seed=1"]},
        "modelCache": {"medium": "Memory", "sizeLimit": "1Ti"},
    },
    "token": {
        "model": {"source": "hf://a/b", "hfTokenSecret": {"name": "s"}},
        "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
        "image": "img:1",
        "imagePullPolicy": "Always",
    },
}

KUBERNETES_MODELS = {
    "Deployment": "V1Deployment",
    "Service": "V1Service",
    "PodDisruptionBudget": "V1PodDisruptionBudget",
}


def _children_of_every_spec() -> Iterator[tuple[str, dict[str, Any]]]:
    for label, raw in SPECS.items():
        for child in render_children(NAME, NAMESPACE, UID, parse_spec(raw), SETTINGS, 2):
            yield f"{label}/{child['kind']}", child


@pytest.mark.parametrize(("label", "child"), list(_children_of_every_spec()))
def test_children_survive_the_kubernetes_models(label: str, child: dict[str, Any]) -> None:
    """A misspelt field would be dropped by the typed model, so the round trip differs."""
    client = ApiClient()
    try:
        model = client._ApiClient__deserialize(child, KUBERNETES_MODELS[child["kind"]])  # type: ignore[attr-defined]
        assert client.sanitize_for_serialization(model) == child, label
    finally:
        client.close()


def test_rendering_is_pure() -> None:
    raw = copy.deepcopy(SPECS["pvc-4gpu"])
    s = parse_spec(raw)
    first = render_children(NAME, NAMESPACE, UID, s, SETTINGS, 3)
    first[0]["spec"]["template"]["spec"]["containers"][0]["args"].append("--mutated")
    first[0]["spec"]["template"]["spec"]["tolerations"][0]["key"] = "mutated"
    second = render_children(NAME, NAMESPACE, UID, s, SETTINGS, 3)
    assert second == render_children(NAME, NAMESPACE, UID, parse_spec(raw), SETTINGS, 3)
    assert "--mutated" not in second[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert second[0]["spec"]["template"]["spec"]["tolerations"][0]["key"] == "k"
    assert raw == SPECS["pvc-4gpu"]


# ---- status.capacity --------------------------------------------------------------------

LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
LLAMA_70B = {
    **LLAMA_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}


def test_capacity_llama_8b_on_one_80gib_gpu() -> None:
    # 8,030,261,248 params × 2 bytes; KV 2 × 32 layers × 8 heads × 128 × 2 bytes per token;
    # (80 GiB × 0.9 − weights) / KV per token = 467,292 → whole 16-token blocks: 467,280.
    assert capacity_status(LLAMA_8B, spec(), "configmap/llama-config") == {
        "tensorParallelSize": 1,
        "weightBytes": 16_060_522_496,
        "kvBytesPerToken": 131_072,
        "tokensPerReplica": 467_280,
        "source": "configmap/llama-config",
    }


def test_capacity_uses_dtype_and_fraction_of_one_rank() -> None:
    s = spec(
        resources={"gpus": 1, "gpuMemoryGiB": 80},
        engine={"dtype": "float32", "kvCacheMemoryFraction": 0.5, "blockSize": 32},
    )
    out = capacity_status(LLAMA_8B, s, "x")
    assert out["weightBytes"] == 8_030_261_248 * 4
    assert out["kvBytesPerToken"] == 262_144
    free = 80 * 0.5 * 2**30 - 8_030_261_248 * 4
    assert out["tokensPerReplica"] == int(free // 262_144) // 32 * 32


def test_capacity_is_one_ranks_with_tensor_parallelism() -> None:
    # 4 GPUs: 4 ranks, each with a quarter of the weights (plus the replicated norms)
    # and 2 of the 8 KV heads in its own 80 GiB × 0.9.
    out = capacity_status(LLAMA_8B, spec(resources={"gpus": 4}), "x")
    assert out["tensorParallelSize"] == 4
    rank_params = rank_num_params(ModelConfig.from_dict(LLAMA_8B), 4)
    assert out["weightBytes"] == 2 * rank_params
    assert out["kvBytesPerToken"] == 131_072 // 4
    free = 80 * 0.9 * 2**30 - 2 * rank_params
    assert out["tokensPerReplica"] == int(free // 32_768) // 16 * 16
    # Two pods of 2 GPUs: the same 4 ranks; an explicit size overrides the GPUs.
    two_nodes = capacity_status(LLAMA_8B, spec(resources={"gpus": 2}, nodes=2), "x")
    assert two_nodes == out
    two = capacity_status(
        LLAMA_8B, spec(resources={"gpus": 4}, engine={"tensorParallelSize": 2}), "x"
    )
    assert (two["tensorParallelSize"], two["kvBytesPerToken"]) == (2, 131_072 // 2)


def test_capacity_refuses_an_unshardable_size() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads=32 is not divisible by 3"):
        capacity_status(LLAMA_8B, spec(resources={"gpus": 3}), "x")


def test_capacity_counts_int8_projections() -> None:
    # 32 layers × 218,103,808 projection weights at 1 byte instead of 2, plus a bf16
    # scale for each of their 32 × 43,008 output rows: the KV cache gets the difference.
    out = capacity_status(LLAMA_8B, spec(engine={"quantization": "int8"}), "x")
    assert out["weightBytes"] == 16_060_522_496 - 32 * 218_103_808 + 2 * 32 * 43_008
    assert out["tokensPerReplica"] > capacity_status(LLAMA_8B, spec(), "x")["tokensPerReplica"]


def test_capacity_counts_an_fp8_kv_cache_at_one_byte() -> None:
    # LLAMA_8B in bf16: 2 × 32 layers × 8 KV heads × 128 × 2 bytes = 131,072 per token.
    bf16 = capacity_status(LLAMA_8B, spec(), "x")
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        out = capacity_status(LLAMA_8B, spec(engine={"kvCacheDtype": kv}), "x")
        assert out["kvBytesPerToken"] == bf16["kvBytesPerToken"] // 2 == 65_536
        assert out["weightBytes"] == bf16["weightBytes"]
        # Twice the tokens, up to the rounding down to whole blocks.
        assert abs(out["tokensPerReplica"] - 2 * bf16["tokensPerReplica"]) <= 16


def test_capacity_auto_dtype_follows_the_checkpoint() -> None:
    fp32 = {**LLAMA_8B, "torch_dtype": "float32"}
    assert capacity_status(fp32, spec(), "x")["weightBytes"] == 8_030_261_248 * 4
    odd = {**LLAMA_8B, "torch_dtype": "float8_e4m3fn"}  # the engine falls back to bf16
    assert capacity_status(odd, spec(), "x")["weightBytes"] == 8_030_261_248 * 2


def test_capacity_70b_needs_the_memory_of_several_gpus() -> None:
    with pytest.raises(ValueError, match=r"weights alone do not fit.*80 GiB × kvCacheMemory"):
        capacity_status(LLAMA_70B, spec(), "x")
    out = capacity_status(LLAMA_70B, spec(resources={"gpus": 4}), "x")
    assert out["tensorParallelSize"] == 4
    assert out["weightBytes"] == 2 * rank_num_params(ModelConfig.from_dict(LLAMA_70B), 4)
    assert out["weightBytes"] < 141_107_412_992 // 3
    assert out["tokensPerReplica"] > 0 and out["tokensPerReplica"] % 16 == 0


def test_capacity_errors() -> None:
    with pytest.raises(ValueError, match=r"^capacity needs GPUs"):
        capacity_status(LLAMA_8B, spec(resources={"gpus": 0}), "x")
    with pytest.raises(ValueError, match=r"config.json: architecture 'GPT2LMHeadModel'"):
        capacity_status({**LLAMA_8B, "architectures": ["GPT2LMHeadModel"]}, spec(), "x")
    with pytest.raises(ValueError, match=r"config.json: .*hidden_size"):
        capacity_status({k: v for k, v in LLAMA_8B.items() if k != "hidden_size"}, spec(), "x")
    with pytest.raises(ValueError, match=r"malformed"):
        capacity_status({**LLAMA_8B, "rope_scaling": {"rope_type": "llama3"}}, spec(), "x")
    # Weights fit, but not one KV block beside them.
    tight = spec(resources={"gpuMemoryGiB": 14.959}, engine={"kvCacheMemoryFraction": 1.0})
    with pytest.raises(ValueError, match=r"no KV-cache block of 16 tokens"):
        capacity_status(LLAMA_8B, tight, "x")
