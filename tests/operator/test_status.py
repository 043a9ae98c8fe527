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
    template_changed: bool = False,
) -> dict[str, Any]:
    return compute_status(
        generation=5,
        desired_replicas=desired,
        deployment=dep,
        previous=previous or {},
        error=error,
        now=now,
        template_changed=template_changed,
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


def becoming_available(replicas: int, available: int) -> dict[str, Any]:
    """Every pod on the latest template, some not available yet: the Deployment
    controller says ReplicaSetUpdated, whether it scales or ends a rollout."""
    return deployment(
        progressing="ReplicaSetUpdated",
        replicas=replicas,
        readyReplicas=available,
        updatedReplicas=replicas,
        availableReplicas=available,
    )


def test_scaling_up_is_not_a_rollout() -> None:
    """spec.replicas 1 → 3 (or the autoscaler): the Deployment controller reports
    ReplicaSetUpdated until the new pods are available, as it does in a rollout, but
    every pod runs the latest template: ScalingUp, not RollingOut."""
    steady = deployment(replicas=1, readyReplicas=1, updatedReplicas=1, availableReplicas=1)
    before = compute(steady, desired=1)
    unobserved = deployment(
        gen=3, observed=2, replicas=1, readyReplicas=1, updatedReplicas=1, availableReplicas=1
    )
    first = compute(unobserved, desired=3, previous=before)
    assert conditions(first)["Progressing"] == ("True", "ScalingUp")
    growing = becoming_available(replicas=3, available=1)
    later = compute(growing, desired=3, previous=first)
    assert conditions(later)["Progressing"] == ("True", "ScalingUp")
    (progressing,) = [c for c in later["conditions"] if c["type"] == "Progressing"]
    assert progressing["message"] == "1/3 replicas available"
    assert conditions(later)["Degraded"] == ("False", "AsExpected")


def test_scaling_down_is_not_a_rollout() -> None:
    shrinking = deployment(
        gen=3, observed=2, replicas=3, readyReplicas=3, updatedReplicas=3, availableReplicas=3
    )
    assert conditions(compute(shrinking, desired=1))["Progressing"] == ("True", "ScalingDown")


def test_a_new_template_rolls_out_before_the_controller_reports_it() -> None:
    """The reconcile that changed the template says RollingOut at once (the controller
    has not looked yet), and so does every later one until the rollout is over, also
    once the old pods are gone and the new ones are still becoming available."""
    unobserved = deployment(
        gen=3, observed=2, replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2
    )
    first = compute(unobserved, template_changed=True)
    assert conditions(first)["Progressing"] == ("True", "RollingOut")
    again = compute(unobserved, previous=first)
    assert conditions(again)["Progressing"] == ("True", "RollingOut")
    tail = becoming_available(replicas=2, available=1)
    assert conditions(compute(tail, previous=again))["Progressing"] == ("True", "RollingOut")
    done = deployment(replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2)
    finished = compute(done, previous=again)
    assert conditions(finished)["Progressing"] == ("False", "RolloutComplete")
    scaled = deployment(
        gen=4, observed=3, replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2
    )
    after = compute(scaled, desired=3, previous=finished)
    assert conditions(after)["Progressing"] == ("True", "ScalingUp")
