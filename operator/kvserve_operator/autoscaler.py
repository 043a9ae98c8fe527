"""Autoscaling decisions from the replicas' own queue metrics.

The rule is the HorizontalPodAutoscaler's, applied to an engine metric:

- recommendation = ceil(Σ metric over ready replicas / target), clamped to [min, max];
- scale up only to a level every recommendation of the last ``scaleUpStabilizationSeconds``
  supports (a sustained queue, not one burst);
- scale down only to the highest recommendation of the last ``scaleDownDelaySeconds``
  (so a lull shorter than the delay never drops warm replicas).

A window counts only once it has been observed in full: after an operator restart the
history is empty, so it waits a whole window again instead of acting on one sample.
``Autoscaler`` is pure (time is passed in) so the rule is unit-tested with a fake clock.
"""

from __future__ import annotations

import math
import urllib.request
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvserve_operator.spec import AutoscalingSpec, Metric

# The engine's gauges (kvserve.telemetry.prometheus) that each spec.autoscaling.metric sums.
WAITING = "kvserve_num_requests_waiting"
RUNNING = "kvserve_num_requests_running"
METRICS: Mapping[Metric, tuple[str, ...]] = {
    "queueDepth": (WAITING,),
    "inFlight": (WAITING, RUNNING),
}


@dataclass(frozen=True)
class Bounds:
    """What the rule needs of an enabled ``spec.autoscaling`` (parsed, defaults filled)."""

    min_replicas: int
    max_replicas: int
    metric: Metric
    target: float
    up_window_s: float
    down_window_s: float

    @classmethod
    def from_spec(cls, autoscaling: AutoscalingSpec) -> Bounds:
        if autoscaling.max_replicas is None:
            # parse_spec refuses an enabled spec without it; a disabled one has no bounds.
            raise ValueError("autoscaling.maxReplicas is required when autoscaling is enabled")
        return cls(
            min_replicas=autoscaling.min_replicas,
            max_replicas=autoscaling.max_replicas,
            metric=autoscaling.metric,
            target=autoscaling.target,
            up_window_s=autoscaling.scale_up_stabilization_seconds,
            down_window_s=autoscaling.scale_down_delay_seconds,
        )

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class Decision:
    replicas: int
    metric: float | None
    recommendation: int | None
    reason: str

    def changed(self, current: int) -> bool:
        return self.replicas != current


@dataclass
class Autoscaler:
    """Per-InferenceModel recommendation history."""

    history: deque[tuple[float, int]] = field(default_factory=deque)
    observed_since: float | None = None

    def decide(
        self, now: float, current: int, metric_total: float | None, bounds: Bounds
    ) -> Decision:
        if current != bounds.clamp(current):
            self.history.clear()
            self.observed_since = None
            return Decision(bounds.clamp(current), metric_total, None, "out of bounds")
        if metric_total is None:
            # No ready replica reported: keep what we have and forget the window, because
            # a gap in the data must not count as a sustained level.
            self.history.clear()
            self.observed_since = None
            return Decision(current, None, None, "no metrics from ready replicas")
        if self.observed_since is None:
            self.observed_since = now
        recommendation = bounds.clamp(math.ceil(metric_total / bounds.target))
        self.history.append((now, recommendation))
        horizon = now - max(bounds.up_window_s, bounds.down_window_s)
        while self.history and self.history[0][0] < horizon:
            self.history.popleft()
        observed = now - self.observed_since
        if recommendation > current:
            if observed < bounds.up_window_s:
                return Decision(
                    current, metric_total, recommendation, "waiting for a sustained queue"
                )
            level = min(r for t, r in self.history if t >= now - bounds.up_window_s)
            target = max(current, level)
            return Decision(target, metric_total, recommendation, _why(metric_total, bounds))
        if recommendation < current:
            if observed < bounds.down_window_s:
                return Decision(
                    current, metric_total, recommendation, "within the scale-down delay"
                )
            level = max(r for t, r in self.history if t >= now - bounds.down_window_s)
            target = min(current, level)
            return Decision(target, metric_total, recommendation, _why(metric_total, bounds))
        return Decision(current, metric_total, recommendation, "at target")


def _why(metric_total: float, bounds: Bounds) -> str:
    return f"{bounds.metric} total {metric_total:g} for target {bounds.target:g} per replica"


def metric_from_text(text: str, names: Iterable[str]) -> float:
    """Sum of the named gauges' samples in a Prometheus text exposition."""
    wanted = set(names)
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            total += sum(sample.value for sample in family.samples)
    return total


def scrape(url: str, names: Iterable[str], timeout: float = 2.0) -> float:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return metric_from_text(response.read().decode(), names)


def pod_metrics_url(template: str, pod: Mapping[str, Any]) -> str | None:
    """The metrics URL of a ready pod, or None when it is not ready / has no IP."""
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    pod_ip = status.get("podIP")
    if not ready or not pod_ip or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    meta = pod.get("metadata") or {}
    return template.format(
        pod_ip=pod_ip, pod_name=meta.get("name"), namespace=meta.get("namespace")
    )
