"""InferenceModel conditions computed from Deployment states."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kvserve_operator.status import compute_status

T0 = datetime(2026, 1, 1, tzinfo=UTC)
T1 = datetime(2026, 1, 1, 0, 5, tzinfo=UTC)


def deployment(
    gen: int = 2, observed: int = 2, progressing: str = "NewReplicaSetAvailable", **counts: int
) -> dict[str, Any]:
    status: dict[str, Any] = {"observedGeneration": observed, **counts}
    status["conditions"] = [
        {"type": "Progressing", "status": "True", "reason": progressing, "message": "m"}
    ]
    return {"metadata": {"generation": gen}, "status": status}


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def compute(
    dep: dict[str, Any] | None,
    desired: int = 2,
    previous: dict[str, Any] | None = None,
    error: str | None = None,
    now: datetime = T0,
) -> dict[str, Any]:
    return compute_status(
        generation=5,
        desired_replicas=desired,
        deployment=dep,
        previous=previous or {},
        error=error,
        now=now,
    )


def test_all_replicas_ready() -> None:
    s = compute(deployment(replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2))
    assert conditions(s) == {
        "Ready": ("True", "ReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert (s["readyReplicas"], s["observedGeneration"]) == (2, 5)


def test_rollout_in_progress_is_not_degraded() -> None:
    s = compute(
        deployment(
            progressing="ReplicaSetUpdated",
            replicas=3,
            readyReplicas=1,
            updatedReplicas=2,
            availableReplicas=1,
        )
    )
    assert conditions(s)["Progressing"] == ("True", "RollingOut")
    assert conditions(s)["Ready"] == ("False", "ReplicasNotReady")
    assert conditions(s)["Degraded"] == ("False", "AsExpected")


def test_stale_observed_generation_counts_as_progressing() -> None:
    s = compute(
        deployment(
            gen=3, observed=2, replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2
        )
    )
    assert conditions(s)["Progressing"][0] == "True"


def test_lost_replica_after_rollout_is_degraded() -> None:
    s = compute(deployment(replicas=2, readyReplicas=1, updatedReplicas=2, availableReplicas=1))
    assert conditions(s)["Degraded"] == ("True", "InsufficientReplicas")


def test_deadline_exceeded_and_errors_are_degraded() -> None:
    s = compute(deployment(progressing="ProgressDeadlineExceeded", replicas=1, updatedReplicas=1))
    assert conditions(s)["Degraded"] == ("True", "ProgressDeadlineExceeded")
    s = compute(None, error="apply failed: forbidden")
    assert conditions(s)["Degraded"] == ("True", "ReconcileError")
    assert conditions(s)["Ready"] == ("False", "DeploymentMissing")
    # The Ready condition says why it is missing, where `kubectl wait` looks.
    (ready,) = [c for c in s["conditions"] if c["type"] == "Ready"]
    assert ready["message"] == "the engine Deployment does not exist yet: apply failed: forbidden"
    s = compute(None)
    (ready,) = [c for c in s["conditions"] if c["type"] == "Ready"]
    assert ready["message"] == "the engine Deployment does not exist yet"


def test_transition_time_changes_only_when_status_flips() -> None:
    ready = deployment(replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2)
    first = compute(ready, now=T0)
    again = compute(ready, previous=first, now=T1)
    assert [c["lastTransitionTime"] for c in again["conditions"]] == [
        c["lastTransitionTime"] for c in first["conditions"]
    ]
    lost = compute(
        deployment(replicas=2, readyReplicas=1, updatedReplicas=2, availableReplicas=1),
        previous=first,
        now=T1,
    )
    times = {c["type"]: c["lastTransitionTime"] for c in lost["conditions"]}
    assert times["Ready"] == "2026-01-01T00:05:00Z"
    assert times["Progressing"] == "2026-01-01T00:00:00Z"


def test_scaled_to_zero() -> None:
    s = compute(deployment(), desired=0)
    assert conditions(s)["Ready"] == ("False", "ScaledToZero")
