"""The InferenceModel's status, computed from its Deployment, or its LeaderWorkerSet with
spec.nodes > 1 (pure: the clock is passed in).

Conditions follow the Kubernetes convention: ``lastTransitionTime`` changes only when
a condition's status flips, so ``kubectl wait --for=condition=Ready`` and dashboards see
real transitions, not every reconcile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from kvserve_operator.constants import LWS_KIND
from kvserve_operator.spec import InferenceModelSpec

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"

# Ready=False reasons when spec.inferencePool.enabled cannot be honoured: the model's
# pods may serve, but the pool the user asked for does not exist.
POOL_CRD_MISSING = "InferencePoolCRDMissing"
POOL_FORBIDDEN = "InferencePoolForbidden"
# Ready=False when spec.nodes > 1 but the API server does not serve LeaderWorkerSets:
# nothing is rendered until it does.
LWS_CRD_MISSING = "LeaderWorkerSetCRDMissing"
# Progressing=True reasons: a new pod template replacing the pods (a new version), or
# only the number of replicas changing (spec.replicas, the autoscaler).
ROLLING_OUT = "RollingOut"
SCALING_UP = "ScalingUp"
SCALING_DOWN = "ScalingDown"

# What status.inferencePool copies from the InferencePool's status (GIE v1 ParentStatus);
# the InferenceModel's status schema is strict, so only these keys are taken.
_PARENT_REF_KEYS = ("group", "kind", "namespace", "name")
_CONDITION_KEYS = (
    "type",
    "status",
    "reason",
    "message",
    "lastTransitionTime",
    "observedGeneration",
)


def rfc3339(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    type_: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    previous: Sequence[Mapping[str, Any]],
    now: datetime,
) -> dict[str, Any]:
    status = "True" if ok else "False"
    last = next((c for c in previous if c.get("type") == type_), None)
    since = (
        last["lastTransitionTime"]
        if last is not None and last.get("status") == status and last.get("lastTransitionTime")
        else rfc3339(now)
    )
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def deployment_counts(deployment: Mapping[str, Any] | None) -> dict[str, int]:
    """The replica counts of a Deployment, or of a LeaderWorkerSet (in groups)."""
    status = (deployment or {}).get("status") or {}
    counts = {
        key: int(status.get(key) or 0)
        for key in ("replicas", "readyReplicas", "updatedReplicas", "availableReplicas")
    }
    if _is_lws(deployment):
        # A LeaderWorkerSet reports no availableReplicas: a group serves once all its
        # pods are ready (it has no minReadySeconds).
        counts["availableReplicas"] = counts["readyReplicas"]
    return counts


def _is_lws(workload: Mapping[str, Any] | None) -> bool:
    return (workload or {}).get("kind") == LWS_KIND


def deployment_condition(deployment: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    conditions = (deployment.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), {})


def rollout_in_progress(deployment: Mapping[str, Any], desired: int) -> bool:
    """True until the Deployment controller reports the latest template fully available
    (a LeaderWorkerSet: every group updated and its UpdateInProgress condition off)."""
    meta = deployment.get("metadata") or {}
    status = deployment.get("status") or {}
    counts = deployment_counts(deployment)
    if _is_lws(deployment):
        # No observedGeneration in a LeaderWorkerSet's status.
        updating = deployment_condition(deployment, "UpdateInProgress")
        return (
            counts["updatedReplicas"] < desired
            or counts["replicas"] > counts["updatedReplicas"]
            or updating.get("status") == "True"
        )
    progressing = deployment_condition(deployment, "Progressing")
    return (
        int(status.get("observedGeneration") or 0) < int(meta.get("generation") or 0)
        or counts["updatedReplicas"] < desired
        or counts["replicas"] > counts["updatedReplicas"]
        or (
            progressing.get("status") == "True"
            and progressing.get("reason") != "NewReplicaSetAvailable"
        )
    )


def rolling_out(
    workload: Mapping[str, Any], template_changed: bool, previous: Sequence[Mapping[str, Any]]
) -> bool:
    """Whether a workload in progress is replacing its pods' template (a rollout), not
    only changing how many there are.

    Pods of an older template still running say so, and a LeaderWorkerSet says it with
    UpdateInProgress; but right after a change its controller has not looked yet, and
    says nothing. So the reconcile that changed the template (``template_changed``, or
    created the workload) starts a rollout, and a rollout the last status reported
    (``previous``) lasts until the workload is no longer in progress."""
    counts = deployment_counts(workload)
    if template_changed or counts["replicas"] > counts["updatedReplicas"]:
        return True
    if deployment_condition(workload, "UpdateInProgress").get("status") == "True":
        return True  # a LeaderWorkerSet's
    last = next((c for c in previous if c.get("type") == PROGRESSING), {})
    return last.get("status") == "True" and last.get("reason") == ROLLING_OUT


def progressing_condition(
    workload: Mapping[str, Any] | None,
    desired: int,
    template_changed: bool,
    previous: Sequence[Mapping[str, Any]],
) -> tuple[bool, str, str]:
    """Progressing: a rollout (RollingOut), a change of replica count (ScalingUp,
    ScalingDown), or neither."""
    if workload is None or not rollout_in_progress(workload, desired):
        return (False, "RolloutComplete", "all replicas run the latest spec")
    counts = deployment_counts(workload)
    if rolling_out(workload, template_changed, previous):
        return (True, ROLLING_OUT, f"{counts['updatedReplicas']}/{desired} replicas updated")
    if counts["replicas"] > desired:
        return (True, SCALING_DOWN, f"{counts['replicas']} replicas, scaling down to {desired}")
    return (True, SCALING_UP, f"{counts['availableReplicas']}/{desired} replicas available")


def compute_status(
    *,
    generation: int,
    desired_replicas: int,
    deployment: Mapping[str, Any] | None,
    previous: Mapping[str, Any],
    error: str | None,
    now: datetime,
    pool_problem: tuple[str, str] | None = None,
    workload_kind: str = "Deployment",
    template_changed: bool = False,
) -> dict[str, Any]:
    """Replica counts and the Ready / Progressing / Degraded conditions.

    ``deployment``: the engine workload, a ``workload_kind`` (Deployment or
    LeaderWorkerSet). ``pool_problem`` (reason, message): the InferencePool asked for
    could not be written, or the workload could not be rendered; Ready is then False
    with that reason, whatever the replicas. ``template_changed``: this reconcile gave
    the workload a new pod template (see ``rolling_out``)."""
    counts = deployment_counts(deployment)
    conditions = previous.get("conditions") or []
    ready = counts["readyReplicas"]
    if deployment is None:
        # Missing because of an error (an invalid spec, a refused apply): say why here too,
        # where `kubectl get` and `kubectl wait --for=condition=Ready` look.
        missing = f"the engine {workload_kind} does not exist yet"
        ready_c = (False, f"{workload_kind}Missing", f"{missing}: {error}" if error else missing)
    elif desired_replicas == 0:
        ready_c = (False, "ScaledToZero", "replicas is 0")
    elif ready >= desired_replicas:
        ready_c = (True, "ReplicasReady", f"{ready}/{desired_replicas} replicas ready")
    else:
        ready_c = (False, "ReplicasNotReady", f"{ready}/{desired_replicas} replicas ready")
    if pool_problem is not None:
        ready_c = (False, *pool_problem)

    progressing_c = progressing_condition(
        deployment, desired_replicas, template_changed, conditions
    )
    progressing = progressing_c[0]

    deadline = deployment_condition(deployment or {}, "Progressing")
    if error is not None:
        degraded_c = (True, "ReconcileError", error)
    elif deadline.get("reason") == "ProgressDeadlineExceeded":
        degraded_c = (True, "ProgressDeadlineExceeded", str(deadline.get("message") or ""))
    elif (
        deployment is not None
        and not progressing
        and counts["availableReplicas"] < desired_replicas
    ):
        degraded_c = (
            True,
            "InsufficientReplicas",
            f"{counts['availableReplicas']}/{desired_replicas} replicas available",
        )
    else:
        degraded_c = (False, "AsExpected", "")

    return {
        "observedGeneration": generation,
        **counts,
        "conditions": [
            condition(t, ok, reason, message, generation, conditions, now)
            for t, (ok, reason, message) in (
                (READY, ready_c),
                (PROGRESSING, progressing_c),
                (DEGRADED, degraded_c),
            )
        ],
    }


def adapters_status(
    spec: InferenceModelSpec, replicas: Sequence[frozenset[str]]
) -> list[dict[str, Any]] | None:
    """status.adapters: each adapter of spec.adapters, its source, and how many of the
    replicas that answered (``replicas``: the adapters each one serves) have it loaded.

    ``None`` (no list) when the spec lists no adapters.
    """
    if not spec.adapters:
        return None
    return [
        {
            "name": a.name,
            "source": a.resolved_source,
            "loadedReplicas": sum(a.name in served for served in replicas),
        }
        for a in spec.adapters
    ]


def inference_pool_status(name: str, pool: Mapping[str, Any] | None) -> dict[str, Any]:
    """status.inferencePool: the pool's name and, per parent (a Gateway) that reports on
    it, the parent and its conditions (Accepted, ResolvedRefs) as the gateway wrote them.

    ``pool``: the InferencePool as the API server returned it (None: not read back)."""
    parents = []
    for parent in ((pool or {}).get("status") or {}).get("parents") or []:
        ref = parent.get("parentRef") or {}
        entry: dict[str, Any] = {
            "parentRef": {k: ref[k] for k in _PARENT_REF_KEYS if k in ref},
            "conditions": [
                {k: c[k] for k in _CONDITION_KEYS if k in c} for c in parent.get("conditions") or []
            ],
        }
        if parent.get("controllerName"):
            entry["controllerName"] = parent["controllerName"]
        parents.append(entry)
    return {"name": name, "parents": parents}
