"""Tensor parallelism in the operator without a cluster: how spec.resources.gpus,
spec.nodes and spec.engine.tensorParallelSize give the ranks, what is refused, the
rendered LeaderWorkerSet (and that nothing which selects engine pods selects its
workers), the CRD's fields for them and status from a LeaderWorkerSet.

The API server's verdict on the LeaderWorkerSet is in test_leader_worker_set_e2e.py.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import pytest
import yaml

from kvserve_operator.crd import engine_properties
from kvserve_operator.render import (
    OperatorSettings,
    engine_args,
    pdb_selector_labels,
    pod_template,
    pool_selector_labels,
    render_children,
    render_inference_pool,
    render_pdb,
    render_service,
    selector_labels,
    selector_string,
    worker_labels,
)
from kvserve_operator.spec import (
    OPERATOR_OWNED_FLAGS,
    TP_FLAGS,
    InferenceModelSpec,
    SpecError,
    parse_spec,
)
from kvserve_operator.status import compute_status

NAME = "big"
NAMESPACE = "models"
UID = "3f0c1d5e-0000-4000-8000-000000000001"
SETTINGS = OperatorSettings()
POOL = {"enabled": True, "endpointPickerRef": {"name": "epp"}}


def spec(**fields: Any) -> InferenceModelSpec:
    return parse_spec({"model": {"source": "hf://meta-llama/Llama-3.1-70B-Instruct"}, **fields})


def arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def children(s: InferenceModelSpec, replicas: int = 2) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in render_children(NAME, NAMESPACE, UID, s, SETTINGS, replicas)}


def matches(labels: dict[str, str], selector: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


# ---- the ranks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "tp", "per_pod"),
    [
        ({}, 1, 1),  # one GPU by default
        ({"resources": {"gpus": 4}}, 4, 4),
        ({"resources": {"gpus": 4}, "nodes": 2}, 8, 4),
        ({"resources": {"gpus": 0}}, 1, 1),  # CPU: one rank per pod
        ({"resources": {"gpus": 0}, "nodes": 3}, 3, 1),
        ({"resources": {"gpus": 8}, "engine": {"tensorParallelSize": 4}}, 4, 4),
        ({"resources": {"gpus": 4}, "nodes": 2, "engine": {"tensorParallelSize": 2}}, 2, 1),
        ({"resources": {"gpus": 0}, "nodes": 2, "engine": {"tensorParallelSize": 4}}, 4, 2),
    ],
)
def test_ranks_follow_gpus_and_nodes(fields: dict[str, Any], tp: int, per_pod: int) -> None:
    s = spec(**fields)
    assert (s.tensor_parallel_size, s.ranks_per_node) == (tp, per_pod)
    args = engine_args(s, "/m", "n")
    assert arg(args, "--tensor-parallel-size") == str(tp)
    assert arg(args, "--nnodes") == (str(s.nodes) if s.nodes > 1 else None)
    # Exactly once: the engine options' generated flag is replaced, not repeated.
    assert args.count("--tensor-parallel-size") == 1


@pytest.mark.parametrize(
    ("fields", "path", "needle"),
    [
        (
            {"nodes": 2, "engine": {"tensorParallelSize": 3}},
            "spec.engine.tensorParallelSize",
            "3 ranks do not split over spec.nodes=2 pods",
        ),
        (
            {"nodes": 2, "resources": {"gpus": 2}, "engine": {"tensorParallelSize": 8}},
            "spec.engine.tensorParallelSize",
            "is 4 ranks per pod, more than the spec.resources.gpus=2",
        ),
        (
            {"resources": {"gpus": 1}, "engine": {"tensorParallelSize": 2}},
            "spec.engine.tensorParallelSize",
            "more than the spec.resources.gpus=1",
        ),
        ({"nodes": 0}, "spec.nodes", "between 1 and 64"),
        ({"nodes": 65}, "spec.nodes", "between 1 and 64"),
        ({"nodes": 1.5}, "spec.nodes", "an integer"),
        ({"engine": {"tensorParallelSize": 0}}, "spec.engine.tensorParallelSize", "between 1"),
        ({"nodes": 2, "lora": {}}, "spec.nodes", "not supported with spec.nodes=2"),
        (
            {"nodes": 2, "adapters": [{"name": "a", "source": "hf://org/a"}]},
            "spec.nodes",
            "adapters are loaded into the leader pod only",
        ),
        (
            {"resources": {"gpus": 2}, "lora": {}},
            "spec.resources.gpus",
            "not supported with 2 tensor-parallel ranks (spec.resources.gpus)",
        ),
        (
            {
                "resources": {"gpus": 0},
                "engine": {"tensorParallelSize": 2},
                "adapters": [{"name": "a", "source": "hf://o/a"}],
            },
            "spec.engine.tensorParallelSize",
            "not supported with 2 tensor-parallel ranks (spec.engine.tensorParallelSize)",
        ),
    ],
)
def test_ranks_that_do_not_fit_are_refused(fields: dict[str, Any], path: str, needle: str) -> None:
    with pytest.raises(SpecError) as info:
        spec(**fields)
    assert info.value.path == path
    assert needle in info.value.message


@pytest.mark.parametrize("flag", TP_FLAGS)
def test_parallel_flags_are_the_operators(flag: str) -> None:
    assert flag in OPERATOR_OWNED_FLAGS
    for form in ([flag, "2"], [f"{flag}=2"]):
        with pytest.raises(SpecError, match="is set by the operator"):
            spec(engine={"extraArgs": form})


# ---- one node: a Deployment, as before ----------------------------------------------------


def test_one_node_renders_a_deployment() -> None:
    out = children(spec(resources={"gpus": 4}))
    assert set(out) == {"Deployment", "Service", "PodDisruptionBudget"}
    assert out["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector_labels(NAME)


# ---- several nodes: a LeaderWorkerSet -----------------------------------------------------


def lws(s: InferenceModelSpec | None = None, replicas: int = 2) -> dict[str, Any]:
    s = s or spec(resources={"gpus": 4}, nodes=2, inferencePool=POOL)
    return children(s, replicas)["LeaderWorkerSet"]


def test_several_nodes_render_a_leader_worker_set() -> None:
    s = spec(resources={"gpus": 4}, nodes=2)
    out = children(s, replicas=3)
    assert "Deployment" not in out
    assert [c["kind"] for c in render_children(NAME, NAMESPACE, UID, s, SETTINGS, 3)] == [
        "LeaderWorkerSet",
        "Service",
        "PodDisruptionBudget",
    ]
    obj = out["LeaderWorkerSet"]
    assert (obj["apiVersion"], obj["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert obj["metadata"]["name"] == NAME and obj["metadata"]["namespace"] == NAMESPACE
    owner = obj["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceModel", UID, True)
    assert obj["spec"]["replicas"] == 3
    group = obj["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    # Each group's own headless Service: the Shared one would be named like our Service.
    assert obj["spec"]["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    assert obj["spec"]["rolloutStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
    }


def test_the_leader_is_the_deployments_pod_with_the_group_flags() -> None:
    s = spec(resources={"gpus": 4}, nodes=2, inferencePool=POOL)
    leader = lws(s)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert leader == pod_template(NAME, s, SETTINGS)
    (engine,) = leader["spec"]["containers"]
    assert arg(engine["args"], "--tensor-parallel-size") == "8"
    assert arg(engine["args"], "--nnodes") == "2"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert {p["name"] for p in engine["ports"]} == {"http", "grpc"}
    # One Deployment pod's template at nodes 1 differs only in those flags.
    one = pod_template(NAME, spec(resources={"gpus": 4}, inferencePool=POOL), SETTINGS)
    assert one["metadata"] == leader["metadata"]
    one_args = one["spec"]["containers"][0]["args"]
    assert arg(one_args, "--tensor-parallel-size") == "4" and "--nnodes" not in one_args


def test_workers_run_the_same_engine_answering_only_health() -> None:
    group = lws()["spec"]["leaderWorkerTemplate"]
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    (lead,), (work,) = leader["spec"]["containers"], worker["spec"]["containers"]
    for key in ("image", "command", "args", "env", "resources", "volumeMounts", "lifecycle"):
        assert work[key] == lead[key], key
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert work[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert work["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert worker["spec"]["initContainers"] == leader["spec"]["initContainers"]
    assert worker["spec"]["volumes"] == leader["spec"]["volumes"]
    assert worker["metadata"] == {"labels": worker_labels(NAME)}  # no scrape annotations


def test_only_leaders_are_selected_for_traffic_and_discovery() -> None:
    s = spec(resources={"gpus": 4}, nodes=2, inferencePool=POOL)
    group = lws(s)["spec"]["leaderWorkerTemplate"]
    leader = group["leaderTemplate"]["metadata"]["labels"]
    worker = group["workerTemplate"]["metadata"]["labels"]
    pool = render_inference_pool(NAME, NAMESPACE, UID, s)
    assert pool is not None
    selectors = {
        "Service (the gateway's EndpointSlices)": render_service(NAME, NAMESPACE, UID, s)["spec"][
            "selector"
        ],
        "InferencePool": pool["spec"]["selector"]["matchLabels"],
        "pool": pool_selector_labels(NAME),
        # The operator's scrapes and status.selector (the scale subresource).
        "selector_string": dict(kv.split("=") for kv in selector_string(NAME).split(",")),
    }
    for what, selector in selectors.items():
        assert matches(leader, selector), what
        assert not matches(worker, selector), what
    # The chart's PodMonitor and NetworkPolicies select engines by these two labels.
    chart_engine = {"app.kubernetes.io/name": "kvserve-engine"}
    assert matches(leader, chart_engine) and not matches(worker, chart_engine)


def test_the_budget_covers_whole_groups() -> None:
    s = spec(resources={"gpus": 4}, nodes=2)
    group = lws(s)["spec"]["leaderWorkerTemplate"]
    budget = render_pdb(NAME, NAMESPACE, UID, s)["spec"]
    assert budget["selector"]["matchLabels"] == pdb_selector_labels(NAME, s)
    assert budget["maxUnavailable"] == 1
    for role in ("leaderTemplate", "workerTemplate"):
        assert matches(group[role]["metadata"]["labels"], budget["selector"]["matchLabels"])
    # Another model's pods are not in it.
    assert not matches(worker_labels("other"), budget["selector"]["matchLabels"])


def test_rendered_leader_worker_set_is_stable() -> None:
    s = spec(resources={"gpus": 2}, nodes=4)
    assert lws(s) == lws(s)


# ---- the CRD ----------------------------------------------------------------------------


def _crd_spec() -> dict[str, Any]:
    text = resources.files("kvserve_operator").joinpath("manifests", "crd.yaml").read_text()
    (version,) = yaml.safe_load(text)["spec"]["versions"]
    out: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return out


def test_crd_nodes_field() -> None:
    nodes = _crd_spec()["properties"]["nodes"]
    assert (nodes["type"], nodes["minimum"], nodes["maximum"], nodes["default"]) == (
        "integer",
        1,
        64,
        1,
    )
    assert "LeaderWorkerSet" in nodes["description"]


def test_crd_gives_tensor_parallel_size_no_default() -> None:
    """An API-server default of 1 would hide the GPUs the ranks otherwise follow."""
    tp = _crd_spec()["properties"]["engine"]["properties"]["tensorParallelSize"]
    assert "default" not in tp
    assert tp == engine_properties()["tensorParallelSize"]
    assert re.search(r"Unset: spec\.resources\.gpus × spec\.nodes", tp["description"])
    assert spec().engine.tensor_parallel_size is None


# ---- names the LeaderWorkerSet controller derives ------------------------------------------


def render_named(name: str, s: InferenceModelSpec, replicas: int = 2) -> list[dict[str, Any]]:
    return render_children(name, NAMESPACE, UID, s, SETTINGS, replicas)


def test_a_name_too_long_for_the_worker_pods_labels_is_refused() -> None:
    """LWS v0.7.0 names a group's worker StatefulSet <name>-<group index>; the
    StatefulSet controller labels its pods controller-revision-hash=<that>-<hash> (up to
    10 characters), at most 63. With 2 groups (index 2 while a rollout surges) a name
    of 52 characters, valid for a Deployment, gives 65; 50 is the most."""
    two_groups = spec(nodes=2, replicas=2)
    render_named("m" * 50, two_groups)
    assert len(f"{'m' * 50}-2-{'h' * 10}") == 63
    with pytest.raises(SpecError, match=r"51 characters.*at most 50.*controller-revision-hash"):
        render_named("m" * 51, two_groups)
    render_named("m" * 52, spec(nodes=1, replicas=2))  # a Deployment's pods: 52 is fine


def test_the_name_limit_follows_the_most_groups_the_spec_allows() -> None:
    autoscaled = spec(nodes=2, autoscaling={"enabled": True, "maxReplicas": 10})
    render_named("m" * 49, autoscaled, replicas=1)  # index up to 10: -10-<hash>
    with pytest.raises(SpecError, match=r"autoscaling\.maxReplicas"):
        render_named("m" * 50, autoscaled, replicas=1)


# ---- status from a LeaderWorkerSet ----------------------------------------------------------

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


def status_of(
    workload: dict[str, Any] | None, desired: int = 2, template_changed: bool = False
) -> dict[str, Any]:
    return compute_status(
        generation=3,
        desired_replicas=desired,
        deployment=workload,
        previous={},
        error=None,
        now=NOW,
        workload_kind="LeaderWorkerSet",
        template_changed=template_changed,
    )


def reasons(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["reason"] for c in status["conditions"]}


def lws_with(**status: Any) -> dict[str, Any]:
    return {"kind": "LeaderWorkerSet", "metadata": {"generation": 5}, "status": status}


def test_status_counts_groups_of_a_leader_worker_set() -> None:
    ready = status_of(lws_with(replicas=2, readyReplicas=2, updatedReplicas=2))
    # No observedGeneration in an LWS's status; no availableReplicas either: ready groups.
    assert (ready["readyReplicas"], ready["availableReplicas"]) == (2, 2)
    assert reasons(ready) == {
        "Ready": "ReplicasReady",
        "Progressing": "RolloutComplete",
        "Degraded": "AsExpected",
    }


def test_status_of_a_leader_worker_set_rolling_out() -> None:
    fresh = status_of(lws_with(), template_changed=True)  # just created
    assert reasons(fresh)["Ready"] == "ReplicasNotReady"
    assert reasons(fresh)["Progressing"] == "RollingOut"
    surge = status_of(lws_with(replicas=3, readyReplicas=2, updatedReplicas=1))
    assert reasons(surge)["Progressing"] == "RollingOut"
    updating = lws_with(
        replicas=2,
        readyReplicas=2,
        updatedReplicas=2,
        conditions=[{"type": "UpdateInProgress", "status": "True"}],
    )
    assert reasons(status_of(updating))["Progressing"] == "RollingOut"
    stuck = status_of(lws_with(replicas=2, readyReplicas=1, updatedReplicas=2))
    assert reasons(stuck)["Degraded"] == "InsufficientReplicas"


def test_status_of_a_leader_worker_set_scaling_is_not_a_rollout() -> None:
    """More groups of the same template (spec.replicas, the autoscaler): ScalingUp. Only
    a new template is RollingOut."""
    up = status_of(lws_with(replicas=2, readyReplicas=2, updatedReplicas=2), desired=3)
    assert reasons(up)["Progressing"] == "ScalingUp"


def test_status_without_the_leader_worker_set_names_it() -> None:
    ready = next(c for c in status_of(None)["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "LeaderWorkerSetMissing"
    assert ready["message"] == "the engine LeaderWorkerSet does not exist yet"


# ---- what `kvserve serve` makes of the arguments -------------------------------------------


def test_the_groups_arguments_are_kvserve_serves() -> None:
    """Leader and worker parse with `kvserve serve`'s own parser; with the environment a
    LeaderWorkerSet gives each pod, they land on the same group as node 0 and 1."""
    import argparse

    from kvserve.parallel.launch import Launch
    from kvserve.server.main import add_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    group = lws(spec(resources={"gpus": 4}, nodes=2))["spec"]["leaderWorkerTemplate"]
    for index, role in enumerate(("leaderTemplate", "workerTemplate")):
        args = parser.parse_args(group[role]["spec"]["containers"][0]["args"])
        assert (args.tensor_parallel_size, args.nnodes) == (8, 2)
        assert args.node_rank is None and args.master_addr is None  # from the environment
        env = {
            "LWS_LEADER_ADDRESS": f"{NAME}-0.{NAME}.{NAMESPACE}",
            "LWS_GROUP_SIZE": "2",
            "LWS_WORKER_INDEX": str(index),
        }
        launch = Launch.resolve(args.nnodes, args.node_rank, args.master_addr, None, env=env)
        assert (launch.nnodes, launch.node_rank) == (2, index)
        assert launch.master_addr == f"{NAME}-0.{NAME}.{NAMESPACE}"
