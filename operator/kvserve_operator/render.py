"""Pure renderers: an InferenceModel's spec → the manifests of its children.

No I/O and no clock, so the same spec always renders byte-identical objects: the
operator server-side applies them on every reconcile and only real changes roll pods.
Every object is a plain dict in the API's camelCase form. Quantities are rendered as
strings (as the typed Kubernetes models hold them); the API server may still
canonicalize one on write (a sizeLimit of 1000000000 reads back as "1G"), which
server-side apply does not count as a change.

Children (all named after the InferenceModel, in its namespace, owned by it):

- Deployment: the engine pods (init container ``model-pull`` + container ``engine``);
  with spec.nodes > 1 a LeaderWorkerSet instead (``leaderworkerset.x-k8s.io/v1``): groups
  of spec.nodes pods, the leader's template the Deployment's and the workers' the same
  container answering only /health, with labels that keep them out of every selector
  (Service, PDB, InferencePool, the operator's and the gateway's discovery)
- Service: ClusterIP with ports http 8000, grpc 50051 and metrics 9090 (→ http)
- PodDisruptionBudget: at most one engine pod evicted at a time
- ConfigMap ``NAME-adapters`` (only with spec.lora or spec.adapters): spec.adapters as
  JSON, mounted into the pods, where the ``adapter-sync`` container pulls, loads and
  unloads them without a restart (docs/inference-model.md, "Adapters")
- InferencePool (``inference.networking.k8s.io/v1``, only with spec.inferencePool.enabled;
  ``render_inference_pool``): the pods as a Gateway API Inference Extension pool. Its CRD
  is GIE's and may be missing, so the reconciler applies it apart from the others.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kvserve.engine_options import flags_from_spec
from kvserve.model.pull import DEFAULT_PVC_ROOT, PVC_ROOT_ENV, ModelSource
from kvserve_operator.constants import (
    API_VERSION,
    GROUP,
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_KIND,
    KIND,
    LWS_API_VERSION,
    LWS_KIND,
    MANAGED_BY_LABEL,
    OPERATOR_NAME,
)
from kvserve_operator.spec import InferenceModelSpec, SpecError, check_adapter_names

HTTP_PORT = 8000
GRPC_PORT = 50051
# The engine serves /metrics on its HTTP port; the Service's metrics port targets it, so
# scrape configs and ServiceMonitors can select the port by name.
METRICS_PORT = 9090

MODEL_CACHE_DIR = "/models"
HF_HOME = f"{MODEL_CACHE_DIR}/.hf-home"
PVC_ROOT = DEFAULT_PVC_ROOT  # /mnt/pvc: claim CLAIM is mounted at /mnt/pvc/CLAIM
TMP_DIR = "/tmp"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
RUN_AS = 1000
# LoRA adapters: the engine's --lora-dir (an emptyDir the adapter-sync container fills),
# and where spec.adapters is mounted from the NAME-adapters ConfigMap.
LORA_DIR = "/adapters"
ADAPTERS_CONFIG_DIR = "/etc/kvserve/adapters"
ADAPTERS_CONFIG_KEY = "adapters.json"
ADAPTER_SYNC_CONTAINER = "adapter-sync"

SERVED_NAME_ANNOTATION = f"{GROUP}/served-name"
MODEL_LABEL = f"{GROUP}/inference-model"
# With spec.inferencePool.enabled, the pods carry this label and the InferencePool selects
# on it. Only pods of a template rendered with the pool on have it, so during the rollout
# that turns the pool on, pods still running without --metrics-compat vllm (whose metrics
# an endpoint picker cannot read) never join the pool.
POOL_LABEL = f"{GROUP}/inference-pool"
# What the endpoint pickers of GIE and llm-d read by default: vLLM's metric names.
POOL_ENGINE_ARGS: tuple[str, ...] = ("--metrics-compat", "vllm")
ENGINE_APP_NAME = "kvserve-engine"
# A LeaderWorkerSet's worker pods: not "kvserve-engine", so that no selector of engine
# pods (Service, PDB, InferencePool, the operator's scrapes, the chart's PodMonitor)
# picks a pod that serves nothing but /health.
WORKER_APP_NAME = "kvserve-engine-worker"

# preStop sleep: endpoints controllers and the gateway drop the pod before SIGTERM starts
# the engine's drain, so no request is sent to an engine that has begun to exit (the
# gateway's retry before any output is only the safety net). The grace period is drain +
# 15 s: this sleep plus a 10 s margin for the process to exit after the drain. Rollouts
# and scale-downs under load lose no request with these settings
# (tests/cluster/test_rollouts.py; docs/inference-model.md, "Rollouts and scale-down").
PRESTOP_SLEEP_SECONDS = 5
GRACE_MARGIN_SECONDS = 15
# Startup: loading a large checkpoint onto the GPU may take minutes; 180 × 10 s = 30 min.
# (Downloading is the init container's job and is not covered by this probe.)
STARTUP_FAILURE_THRESHOLD = 180
# A rollout may include a download of tens of GB plus loading; the Deployment controller
# should not report ProgressDeadlineExceeded after its default 10 minutes.
PROGRESS_DEADLINE_SECONDS = 3600

_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME_LENGTH = 52


@dataclass(frozen=True)
class OperatorSettings:
    """Operator-wide settings (command line / environment of the operator)."""

    engine_image: str = "ghcr.io/kvserve/kvserve:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    cluster_domain: str = "cluster.local"


# ---- names and labels -------------------------------------------------------------------


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select an InferenceModel's engine pods (immutable in a Deployment)."""
    return {"app.kubernetes.io/name": ENGINE_APP_NAME, "app.kubernetes.io/instance": name}


def selector_string(name: str) -> str:
    """``selector_labels`` as a label selector string, for status.selector (scale)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def child_labels(name: str, spec: InferenceModelSpec | None = None) -> dict[str, str]:
    """Labels of every child and of the pods.

    ``spec`` is accepted for callers' convenience; no label depends on it (the served
    name may not fit a label value, so it goes in the ``kvserve.dev/served-name``
    annotation instead).
    """
    return {
        **selector_labels(name),
        "app.kubernetes.io/component": "engine",
        MANAGED_BY_LABEL: OPERATOR_NAME,
        MODEL_LABEL: name,
    }


def pod_labels(name: str, spec: InferenceModelSpec) -> dict[str, str]:
    """Labels of the engine pods: ``child_labels``, plus the pool's label with the pool on."""
    labels = child_labels(name)
    if spec.inference_pool.enabled:
        labels[POOL_LABEL] = name
    return labels


def worker_labels(name: str) -> dict[str, str]:
    """Labels of a LeaderWorkerSet's worker pods: the model's, but not the engine's
    selector labels (``selector_labels``), which only leaders carry."""
    return {
        "app.kubernetes.io/name": WORKER_APP_NAME,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "engine-worker",
        MANAGED_BY_LABEL: OPERATOR_NAME,
        MODEL_LABEL: name,
    }


def pool_selector_labels(name: str) -> dict[str, str]:
    """What the InferencePool selects: this model's engine pods rendered with the pool on."""
    return {**selector_labels(name), POOL_LABEL: name}


def served_name(name: str, spec: InferenceModelSpec) -> str:
    """What clients send as "model": spec.model.servedName, else the resource's name."""
    return spec.model.served_name or name


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """Makes the InferenceModel the controller of a child: deleting it deletes them."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def check_name(name: str) -> None:
    """The CRD enforces this too; repeated so an older CRD cannot produce bad children."""
    if len(name) > MAX_NAME_LENGTH or not _DNS1035_LABEL.fullmatch(name):
        raise SpecError(
            "metadata.name",
            f"{name!r} must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters",
        )


# A LeaderWorkerSet (sigs.k8s.io/lws v0.7.0) names a group's worker StatefulSet after
# its leader pod, <name>-<group index>, and the StatefulSet controller labels each worker
# pod controller-revision-hash=<that StatefulSet>-<hash of up to 10 characters>: a label
# value, at most 63 characters. Group indexes go up to the most groups the spec allows,
# one more while a rollout surges (ROLLING_UPDATE's maxSurge: 1).
LABEL_VALUE_MAX_LENGTH = 63
REVISION_HASH_MAX_LENGTH = 10


def max_group_name_length(spec: InferenceModelSpec) -> int:
    """The longest name whose LeaderWorkerSet's worker pods get valid labels."""
    a = spec.autoscaling
    groups = a.max_replicas if a.enabled and a.max_replicas is not None else spec.replicas
    highest_index = groups + ROLLING_UPDATE["maxSurge"] - 1
    return LABEL_VALUE_MAX_LENGTH - REVISION_HASH_MAX_LENGTH - len(f"--{highest_index}")


def check_group_name(name: str, spec: InferenceModelSpec) -> None:
    """With spec.nodes > 1: refuse a name too long for the worker pods' labels (the LWS
    controller would create the StatefulSet, whose pods the API server then refuses)."""
    limit = max_group_name_length(spec)
    if spec.nodes > 1 and len(name) > limit:
        groups = "autoscaling.maxReplicas" if spec.autoscaling.enabled else "replicas"
        raise SpecError(
            "metadata.name",
            f"{name!r} has {len(name)} characters; with spec.nodes > 1 and {groups} as "
            f"set, at most {limit}: the LeaderWorkerSet's worker pods are labelled "
            f"controller-revision-hash=<name>-<group index>-<hash>, at most "
            f"{LABEL_VALUE_MAX_LENGTH} characters",
        )


def _metadata(
    name: str, namespace: str, uid: str, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": child_labels(name),
    }
    if annotations:
        meta["annotations"] = annotations
    meta["ownerReferences"] = [owner_reference(name, uid)]
    return meta


# ---- the engine's command line ----------------------------------------------------------


def model_dir(spec: InferenceModelSpec) -> str:
    """Where the engine reads the checkpoint (and where the init container puts it).

    hf://: a directory in the model-cache emptyDir. pvc:// and file://: the source's own
    path, so ``kvserve model pull`` only verifies it in place (no copy). Raises SpecError
    for a file:// path that a volume of the pod would hide.
    """
    return _model_dir(spec.source, spec.lora_enabled)


def _model_dir(source: ModelSource, lora: bool) -> str:
    if source.kind == "hf":
        assert source.repo_id is not None
        # parse_source forbids "--" in repo ids, so "org--name" cannot collide.
        dirname = re.sub(r"[^A-Za-z0-9._-]", "-", source.repo_id.replace("/", "--"))
        return f"{MODEL_CACHE_DIR}/{dirname}"
    if source.kind == "pvc":
        base = f"{PVC_ROOT}/{source.claim}"
        return f"{base}/{source.path}" if source.path else base
    # With LoRA on, the engine also mounts the adapters' volume.
    mounted = (MODEL_CACHE_DIR, TMP_DIR, PVC_ROOT, *((LORA_DIR,) if lora else ()))
    _check_not_hidden(source.path, "spec.model.source", "model", mounted)
    return source.path


def _check_not_hidden(path: str, field: str, what: str, mounted: Sequence[str]) -> None:
    """A file:// path in the image is unreadable under any of the ``mounted`` folders: a
    volume mounted there hides the image's files (SpecError on ``field``)."""
    normal = posixpath.normpath(path)  # /opt/../models/x is /models/x
    for folder in mounted:
        if normal == folder or normal.startswith(f"{folder}/"):
            raise SpecError(
                field,
                f"file://{path} is hidden by the pod's {folder} volume; "
                f"a file:// {what} must live elsewhere in the image",
            )


def check_adapter_sources(spec: InferenceModelSpec) -> None:
    """A file:// adapter must be readable by the adapter-sync container, which mounts
    what the model pull does plus the adapters' own folders."""
    mounted = (MODEL_CACHE_DIR, TMP_DIR, PVC_ROOT, LORA_DIR, ADAPTERS_CONFIG_DIR)
    for i, adapter in enumerate(spec.adapters):
        source = adapter.parsed_source
        if source.kind == "file":
            _check_not_hidden(source.path, f"spec.adapters[{i}].source", "adapter", mounted)


def adapters_config_map_name(name: str) -> str:
    return f"{name}-adapters"


def lora_args(spec: InferenceModelSpec) -> list[str]:
    """The LoRA flags of ``kvserve serve`` (none when spec.lora and spec.adapters are unset).

    No --lora-modules: every adapter is loaded at run time by the adapter-sync container,
    so the list can change without a restart."""
    if not spec.lora_enabled:
        return []
    limits = spec.lora_limits
    args = [
        "--enable-lora",
        "--max-loras",
        str(limits.max_loras),
        "--max-lora-rank",
        str(limits.max_rank),
    ]
    if limits.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(limits.max_cpu_loras)]
    return [*args, "--lora-dir", LORA_DIR]


def adapters_config(spec: InferenceModelSpec) -> str:
    """The ConfigMap's ``adapters.json``: what ``kvserve adapters sync --config`` reads."""
    adapters = [{"name": a.name, "source": a.resolved_source} for a in spec.adapters]
    return json.dumps({"adapters": adapters}, indent=1, sort_keys=True) + "\n"


def engine_args(spec: InferenceModelSpec, model_dir: str, served_name: str) -> list[str]:
    """Arguments of ``kvserve serve`` (after the command); extraArgs come last."""
    e = spec.engine
    options = {**e.engine_options(), "tensorParallelSize": spec.tensor_parallel_size}
    args = [
        "--model",
        model_dir,
        "--served-model-name",
        served_name,
        "--host",
        "0.0.0.0",
        "--port",
        str(HTTP_PORT),
        "--grpc-port",
        str(GRPC_PORT),
        # Explicit, so a pod without GPUs never grabs one it can see but did not request,
        # and a GPU pod on a broken node fails fast instead of loading on the CPU.
        "--device",
        "cuda" if spec.resources.gpus > 0 else "cpu",
        # The engine options, by the engine's own schema (kvserve.engine_options).
        *flags_from_spec(options),
        # With several pods, each runs tensorParallelSize / nodes ranks; the
        # LeaderWorkerSet's environment (LWS_LEADER_ADDRESS, LWS_WORKER_INDEX) gives the
        # rendezvous address and each pod's rank.
        *(["--nnodes", str(spec.nodes)] if spec.nodes > 1 else []),
        "--drain-timeout",
        str(e.drain_timeout_seconds),
        *lora_args(spec),
        *(POOL_ENGINE_ARGS if spec.inference_pool.enabled else ()),
    ]
    return args + list(e.extra_args)


def desired_replicas(
    spec: InferenceModelSpec, autoscaler_replicas: int | None, floor: int = 0
) -> int:
    """Replicas for the Deployment: spec.replicas, or the autoscaler's choice within bounds.

    Without a decision yet (``None``) the autoscaler starts at minReplicas. ``floor``
    raises minReplicas (1 where no gateway can say that requests wait for a replica).
    """
    a = spec.autoscaling
    if not a.enabled:
        return spec.replicas
    wanted = a.min_replicas if autoscaler_replicas is None else autoscaler_replicas
    wanted = max(wanted, a.min_replicas, floor)
    if a.max_replicas is not None:
        wanted = min(wanted, a.max_replicas)
    return wanted


# ---- children ---------------------------------------------------------------------------


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _cpu_threads_env(
    spec: InferenceModelSpec, user_env: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A CPU engine computes with as many threads as its CPU request (at least one):
    PyTorch would otherwise start one per CPU of the node, and with the node's other pods
    busy every op waits for threads that are not running (docs/inference-model.md,
    "spec.resources"). Unless ``spec.env`` sets OMP_NUM_THREADS itself."""
    cpu = spec.resources.cpu
    if (
        spec.resources.gpus > 0
        or cpu is None
        or any(v["name"] == OMP_NUM_THREADS for v in user_env)
    ):
        return []
    return [_env(OMP_NUM_THREADS, str(max(1, math.floor(parse_quantity(cpu)))))]


def _container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _engine_resources(spec: InferenceModelSpec) -> dict[str, Any]:
    r = spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if r.cpu is not None:
        requests["cpu"] = str(r.cpu)  # no CPU limit: throttling would stall decode steps
    if r.memory is not None:
        requests["memory"] = str(r.memory)
        limits["memory"] = str(r.memory)
    if r.gpus > 0:
        # Extended resources: requests must equal limits; both are set explicitly so the
        # rendered object matches what the API server stores.
        requests[r.gpu_resource_name] = str(r.gpus)
        limits[r.gpu_resource_name] = str(r.gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def pod_template(name: str, spec: InferenceModelSpec, settings: OperatorSettings) -> dict[str, Any]:
    """The engine pod's template (a Deployment's, or a LeaderWorkerSet's leader's): pull
    the model in an init container, then serve it."""
    source = spec.source
    dest = _model_dir(source, spec.lora_enabled)
    image = spec.image or settings.engine_image
    pull_policy = spec.image_pull_policy or settings.image_pull_policy
    name_served = served_name(name, spec)

    mounts: list[dict[str, Any]] = [
        {"name": "model-cache", "mountPath": MODEL_CACHE_DIR},
        {"name": "tmp", "mountPath": TMP_DIR},
    ]
    cache: dict[str, Any] = {"sizeLimit": str(spec.model_cache.size_limit)}
    if spec.model_cache.medium:
        cache["medium"] = spec.model_cache.medium
    volumes: list[dict[str, Any]] = [
        {"name": "model-cache", "emptyDir": cache},
        {"name": "tmp", "emptyDir": {}},
    ]
    if source.kind == "pvc":
        mounts.append(
            {"name": "model-pvc", "mountPath": f"{PVC_ROOT}/{source.claim}", "readOnly": True}
        )
        volumes.append(
            {
                "name": "model-pvc",
                "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True},
            }
        )

    pull_env = [
        _env("HOME", TMP_DIR),
        _env("HF_HOME", HF_HOME),
        _env(PVC_ROOT_ENV, PVC_ROOT),
    ]
    secret = spec.model.hf_token_secret
    if secret is not None:
        # Only the init container downloads, so only it sees the token.
        pull_env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}},
            }
        )
    init_container: dict[str, Any] = {
        "name": "model-pull",
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["kvserve", "model", "pull", spec.model.source, dest],
        "env": pull_env,
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "securityContext": _container_security_context(),
        "volumeMounts": mounts,
    }

    user_env = [dict(v) for v in spec.env]
    engine_env = (
        ([] if any(v["name"] == "HOME" for v in user_env) else [_env("HOME", TMP_DIR)])
        + _cpu_threads_env(spec, user_env)
        + user_env
    )
    engine: dict[str, Any] = {
        "name": "engine",
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["kvserve", "serve"],
        "args": engine_args(spec, dest, name_served),
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
        ],
        "env": engine_env,
        "resources": _engine_resources(spec),
        "startupProbe": _http_probe("/ready", 10, STARTUP_FAILURE_THRESHOLD),
        "readinessProbe": _http_probe("/ready", 5, 2),
        "livenessProbe": _http_probe("/health", 10, 6),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": _container_security_context(),
        "volumeMounts": [dict(m) for m in mounts],
    }
    containers = [engine]
    if spec.lora_enabled:
        # Nothing here depends on spec.adapters (only the ConfigMap does), so changing the
        # list never changes the pod template and never rolls the pods.
        volumes.append({"name": "adapters", "emptyDir": {}})
        volumes.append(
            {
                "name": "adapters-config",
                "configMap": {"name": adapters_config_map_name(name)},
            }
        )
        engine["volumeMounts"].append({"name": "adapters", "mountPath": LORA_DIR, "readOnly": True})
        containers.append(_adapter_sync_container(image, pull_policy, pull_env, mounts))

    r = spec.resources
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the engine never calls the Kubernetes API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.engine.drain_timeout_seconds + GRACE_MARGIN_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            # Large model PVCs: do not chown every file on each mount.
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [init_container],
        "containers": containers,
        "volumes": volumes,
    }
    if r.node_selector:
        pod_spec["nodeSelector"] = dict(r.node_selector)
    if r.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in r.tolerations]
    if r.priority_class_name:
        pod_spec["priorityClassName"] = r.priority_class_name

    return {
        "metadata": {
            "labels": pod_labels(name, spec),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(HTTP_PORT),
                "prometheus.io/path": "/metrics",
                SERVED_NAME_ANNOTATION: name_served,
            },
        },
        "spec": pod_spec,
    }


# Zero downtime: a new pod (group) must be ready before an old one goes, so capacity
# never drops below spec.replicas. A surge of one keeps what a rollout needs beyond
# spec.replicas to one replica's GPUs (a larger surge would be faster only where that
# many more GPUs are free).
ROLLING_UPDATE = {"maxSurge": 1, "maxUnavailable": 0}


def render_deployment(
    name: str,
    namespace: str,
    uid: str,
    spec: InferenceModelSpec,
    settings: OperatorSettings,
    replicas: int,
) -> dict[str, Any]:
    """The engine Deployment (spec.nodes 1)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace, uid),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": dict(ROLLING_UPDATE)},
            "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
            "template": pod_template(name, spec, settings),
        },
    }


def worker_template(leader: dict[str, Any], name: str) -> dict[str, Any]:
    """A LeaderWorkerSet's worker pod, from its leader's template: the same engine
    container, volumes and arguments (its rank comes from LWS_WORKER_INDEX), but its
    probes on /health (a worker serves nothing else) and labels outside every engine
    selector (``worker_labels``)."""
    spec = json.loads(json.dumps(leader["spec"]))  # a deep copy of plain JSON
    (engine,) = (c for c in spec["containers"] if c["name"] == "engine")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        engine[probe]["httpGet"]["path"] = "/health"
    # Only the leader serves the API; a worker's gRPC port would be a lie.
    engine["ports"] = [p for p in engine["ports"] if p["name"] == "http"]
    return {"metadata": {"labels": worker_labels(name)}, "spec": spec}


def as_leader_worker_set(deployment: dict[str, Any], nodes: int) -> dict[str, Any]:
    """The engine LeaderWorkerSet (spec.nodes > 1) in place of ``deployment``: as many
    groups of ``nodes`` pods as it has replicas, the leader pod its pod (same labels,
    probes and ports), so everything that selects engine pods selects the leaders; the
    workers join the leader's torch.distributed group."""
    leader = deployment["spec"]["template"]
    name = deployment["metadata"]["name"]
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": deployment["metadata"],
        "spec": {
            "replicas": deployment["spec"]["replicas"],
            # Workers start with the leader: their ranks rendezvous at it while it loads.
            "startupPolicy": "LeaderCreated",
            # LWS_LEADER_ADDRESS is <leader pod>.<subdomain>.<namespace>, which resolves
            # through a headless Service named after the subdomain. The default (Shared)
            # subdomain is the LeaderWorkerSet's name, which is also our ClusterIP
            # Service's: the controller then creates no headless Service (LWS v0.7.0,
            # CreateHeadlessServiceIfNotExists) and the workers cannot find the leader.
            # UniquePerReplica gives each group a headless Service named after its leader.
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": dict(ROLLING_UPDATE),
            },
            "leaderWorkerTemplate": {
                "size": nodes,
                # A torch.distributed group does not survive the loss of one rank: a pod
                # that restarts takes its whole group down and up again.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker_template(leader, name),
            },
        },
    }


def _adapter_sync_container(
    image: str, pull_policy: str, pull_env: list[dict[str, Any]], mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    """The sidecar that keeps the engine's loaded adapters equal to the mounted list."""
    return {
        "name": ADAPTER_SYNC_CONTAINER,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": [
            "kvserve",
            "adapters",
            "sync",
            "--config",
            f"{ADAPTERS_CONFIG_DIR}/{ADAPTERS_CONFIG_KEY}",
            "--lora-dir",
            LORA_DIR,
            "--url",
            f"http://127.0.0.1:{HTTP_PORT}",
        ],
        # The same environment as the model pull: HOME, the Hub cache, the claims' root
        # and the Hub token (private adapters), never given to the engine.
        "env": [dict(v) for v in pull_env],
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
        "securityContext": _container_security_context(),
        "volumeMounts": [
            *(dict(m) for m in mounts),
            {"name": "adapters", "mountPath": LORA_DIR},
            {"name": "adapters-config", "mountPath": ADAPTERS_CONFIG_DIR, "readOnly": True},
        ],
    }


def render_adapters_config_map(
    name: str, namespace: str, uid: str, spec: InferenceModelSpec
) -> dict[str, Any]:
    """spec.adapters for the adapter-sync container; the kubelet updates the mounted
    file in place when this changes, so adapters come and go without a restart."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**_metadata(name, namespace, uid), "name": adapters_config_map_name(name)},
        "data": {ADAPTERS_CONFIG_KEY: adapters_config(spec)},
    }


def render_service(name: str, namespace: str, uid: str, spec: InferenceModelSpec) -> dict[str, Any]:
    """ClusterIP Service; the gateway finds replicas through its EndpointSlices."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(
            name, namespace, uid, {SERVED_NAME_ANNOTATION: served_name(name, spec)}
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": "grpc",
                    "port": GRPC_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "grpc",
                },
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def pdb_selector_labels(name: str, spec: InferenceModelSpec) -> dict[str, str]:
    """The engine pods, and with spec.nodes > 1 the workers too: evicting a worker takes
    its whole group down, as evicting its leader does."""
    if spec.nodes > 1:
        return {"app.kubernetes.io/instance": name, MODEL_LABEL: name}
    return selector_labels(name)


def render_pdb(name: str, namespace: str, uid: str, spec: InferenceModelSpec) -> dict[str, Any]:
    """Node drains evict at most one engine pod at a time (each drains as on any
    deletion: preStop, SIGTERM, drain). Rollouts are paced by the Deployment's (or the
    LeaderWorkerSet's) strategy, not by this budget."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, uid),
        "spec": {
            "selector": {"matchLabels": pdb_selector_labels(name, spec)},
            "maxUnavailable": 1,
            # A pod that never became ready (stuck loading) must not block a drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def render_inference_pool(
    name: str, namespace: str, uid: str, spec: InferenceModelSpec
) -> dict[str, Any] | None:
    """The GIE InferencePool of the model's pods; None unless spec.inferencePool.enabled.

    Named after the InferenceModel. The gateway sends each request to the pod that the
    endpoint picker named in endpointPickerRef chooses, on the engine's HTTP port (where
    it also reads the pod's /metrics).
    """
    pool = spec.inference_pool
    if not pool.enabled:
        return None
    picker = pool.endpoint_picker_ref
    assert picker is not None  # parse_spec requires it when enabled
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": INFERENCE_POOL_KIND,
        "metadata": _metadata(name, namespace, uid),
        "spec": {
            "selector": {"matchLabels": pool_selector_labels(name)},
            "targetPorts": [{"number": HTTP_PORT}],
            # group and kind are GIE's defaults, written out so the applied object says
            # what it refers to: a Service in the pool's namespace.
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker.name,
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }


def render_children(
    name: str,
    namespace: str,
    uid: str,
    spec: InferenceModelSpec,
    settings: OperatorSettings,
    replicas: int,
) -> list[dict[str, Any]]:
    """The adapters' ConfigMap (with LoRA on: the pods mount it, so it comes first), then
    the Deployment (or LeaderWorkerSet), Service and PodDisruptionBudget, in the order
    they should be applied."""
    check_name(name)
    check_group_name(name, spec)
    check_adapter_names(spec.adapters, served_name(name, spec))
    check_adapter_sources(spec)
    config = [render_adapters_config_map(name, namespace, uid, spec)] if spec.lora_enabled else []
    deployment = render_deployment(name, namespace, uid, spec, settings, replicas)
    return [
        *config,
        as_leader_worker_set(deployment, spec.nodes) if spec.nodes > 1 else deployment,
        render_service(name, namespace, uid, spec),
        render_pdb(name, namespace, uid, spec),
    ]


def endpoint_status(name: str, namespace: str, settings: OperatorSettings) -> dict[str, Any]:
    """status.endpoint: how clients reach the model inside the cluster."""
    host = f"{name}.{namespace}.svc.{settings.cluster_domain}"
    return {
        "service": name,
        "host": host,
        "httpPort": HTTP_PORT,
        "grpcPort": GRPC_PORT,
        "metricsPort": METRICS_PORT,
        "url": f"http://{host}:{HTTP_PORT}",
    }
