"""Autoscaling decisions from the replicas' own queue metrics.

The rule is the HorizontalPodAutoscaler's, applied to an engine metric:

- recommendation = ceil(Σ metric over ready replicas / target), clamped to [min, max];
  a ready replica whose metrics did not come counts as at target for a scale-down (and as
  0 for a scale-up), as the HPA counts a pod without metrics: a replica too busy to
  answer is not taken away for it;
- scale up only to a level every recommendation of the last ``scaleUpStabilizationSeconds``
  supports (a sustained queue, not one burst);
- scale down only to the highest recommendation of the last ``scaleDownDelaySeconds``
  (so a lull shorter than the delay never drops warm replicas).

A window counts only once it has been observed in full: after an operator restart the
history is empty, so it waits a whole window again instead of acting on one sample.

With ``minReplicas: 0`` (scale from zero) the rule above never goes below 1; zero is
reached and left on the model's ``Activity`` instead, which includes the gateways'
``kvserve_gateway_held_requests`` (requests held because the model has no replica):

- at 0 replicas, any held request scales to 1 at once (the requests are waiting: a
  stabilisation window would only add to the cold start);
- at 1 or more, ``scaleToZeroAfterSeconds`` without any request (none held, none in the
  replicas, the gateways' answered-request counter unchanged) scales to 0;
- without gateway metrics (``None``) it never scales to zero: a request could be waiting.
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
    idle_s: float = 300.0  # scaleToZeroAfterSeconds (with min_replicas 0)

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
            idle_s=autoscaling.scale_to_zero_after_seconds,
        )

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))

    def clamp_running(self, replicas: int) -> int:
        """Within the bounds and at least 1: only ``Activity`` scales to zero."""
        return max(1, self.clamp(replicas))


@dataclass(frozen=True)
class Scrape:
    """The engine gauges of a model's ready replicas: summed over those that answered
    (``answered`` of them), and how many did not (``missing``)."""

    totals: Mapping[str, float]
    answered: int
    missing: int = 0

    def metric(self, metric: Metric) -> float:
        """The sum of ``metric``'s gauges over the replicas that answered."""
        return sum(self.totals[g] for g in METRICS[metric])

    def per_replica(self, metric: Metric) -> float:
        """``metric``'s average over the replicas that answered (status.currentMetric)."""
        return round(self.metric(metric) / self.answered, 3)


@dataclass(frozen=True)
class Activity:
    """Requests for one model, beyond its replicas' queue metric (scale from zero)."""

    held: float  # held by the gateways because the model has no replica
    answered: float  # the gateways' counter of the model's answered requests
    in_replicas: float  # waiting + running in its ready replicas


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
    # Scale from zero: when a request was last seen, and the gateways' counter then.
    last_request: float | None = None
    answered: float | None = None

    def decide(
        self,
        now: float,
        current: int,
        metric_total: float | None,
        bounds: Bounds,
        activity: Activity | None = None,
        missing: int = 0,
    ) -> Decision:
        """``metric_total``: the metric summed over the ready replicas that answered
        (None: none did); ``missing``: the ready replicas that did not."""
        if bounds.min_replicas == 0 and current == bounds.clamp(current):
            zero = self._zero(now, current, metric_total, bounds, activity)
            if zero is not None:
                self.history.clear()
                self.observed_since = None
                return zero
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
        recommendation = bounds.clamp_running(math.ceil(metric_total / bounds.target))
        if recommendation < current and missing:  # those at target (see the module doc)
            at_target = math.ceil((metric_total + missing * bounds.target) / bounds.target)
            recommendation = min(current, bounds.clamp_running(at_target))
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

    def _zero(
        self,
        now: float,
        current: int,
        metric_total: float | None,
        bounds: Bounds,
        activity: Activity | None,
    ) -> Decision | None:
        """The decision to leave or go to zero replicas; None: the rule above decides."""
        if activity is None:
            # No gateway answered: requests may be held unseen, so never drop to zero.
            return (
                Decision(current, metric_total, None, "no gateway metrics") if not current else None
            )
        counted = self.answered is not None and activity.answered != self.answered
        self.answered = activity.answered
        if activity.held > 0 or activity.in_replicas > 0 or counted or self.last_request is None:
            # (None: first look since a restart; the idle time counts from now.)
            self.last_request = now
        if current == 0:
            if activity.held > 0:
                why = f"{activity.held:g} requests held at the gateway: scaling from zero"
                return Decision(1, metric_total, 1, why)
            return Decision(0, metric_total, 0, "scaled to zero: no requests")
        idle = now - self.last_request
        if idle >= bounds.idle_s:
            return Decision(0, metric_total, 0, f"no requests for {idle:g} s: scaling to zero")
        return None


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


def samples_from_text(
    text: str, names: Iterable[str], labels: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Per sample name, the sum of its samples whose labels include ``labels`` (a
    counter by its ``_total`` sample name)."""
    wanted = set(names)
    out = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and (labels or {}).items() <= sample.labels.items():
                out[sample.name] += sample.value
    return out


def scrape_samples(
    url: str, names: Iterable[str], labels: Mapping[str, str] | None = None, timeout: float = 2.0
) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return samples_from_text(response.read().decode(), names, labels)


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
