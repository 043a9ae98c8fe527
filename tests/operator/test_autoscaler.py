"""The autoscaling rule with a fake clock, and reading the engine's metrics text."""

from __future__ import annotations

import pytest

from kvserve_operator import spec as spec_module
from kvserve_operator.autoscaler import (
    METRICS,
    RUNNING,
    WAITING,
    Activity,
    Autoscaler,
    Bounds,
    Scrape,
    metric_from_text,
    pod_metrics_url,
    samples_from_text,
)
from kvserve_operator.spec import AutoscalingSpec, parse_spec

BOUNDS = Bounds(
    min_replicas=1, max_replicas=4, metric="queueDepth", target=2, up_window_s=10, down_window_s=60
)


def run(scaler: Autoscaler, samples: list[tuple[float, float | None]], current: int) -> list[int]:
    out = []
    for t, metric in samples:
        current = scaler.decide(t, current, metric, BOUNDS).replicas
        out.append(current)
    return out


def test_scale_up_waits_for_a_sustained_queue() -> None:
    # A queue of 6 wants 3 replicas, but only once it has lasted the whole up window.
    replicas = run(Autoscaler(), [(t, 6.0) for t in range(0, 12, 2)], current=1)
    assert replicas == [1, 1, 1, 1, 1, 3]


def test_a_burst_shorter_than_the_up_window_does_not_scale() -> None:
    samples = [(0, 6.0), (2, 6.0), (4, 0.0), (6, 6.0), (8, 6.0), (10, 0.0), (12, 0.0)]
    assert run(Autoscaler(), samples, current=1) == [1] * len(samples)


def test_scale_up_never_exceeds_max() -> None:
    replicas = run(Autoscaler(), [(t, 100.0) for t in range(0, 22, 2)], current=1)
    assert max(replicas) == 4 and replicas[-1] == 4


def test_scale_down_only_after_the_delay_and_never_below_min() -> None:
    scaler = Autoscaler()
    replicas = run(scaler, [(t, 0.0) for t in range(0, 70, 5)], current=4)
    assert replicas[:12] == [4] * 12  # t < 60: within the scale-down delay
    assert replicas[-1] == 1


def test_scale_down_holds_the_highest_level_of_the_window() -> None:
    scaler = Autoscaler()
    # A high queue at t=50 keeps 3 replicas until it leaves the 60 s window.
    samples = (
        [(t, 0.0) for t in range(0, 50, 10)] + [(50, 6.0)] + [(t, 0.0) for t in range(60, 130, 10)]
    )
    replicas = run(scaler, samples, current=3)
    assert replicas[samples.index((60, 0.0))] == 3
    assert replicas[-1] == 1


def test_missing_metrics_reset_the_window() -> None:
    scaler = Autoscaler()
    samples = [(0, 6.0), (4, 6.0), (8, None), (12, 6.0), (16, 6.0), (20, 6.0), (24, 6.0)]
    assert run(scaler, samples, current=1) == [1, 1, 1, 1, 1, 1, 3]


def test_a_ready_replica_without_metrics_counts_at_target_for_a_scale_down() -> None:
    """3 replicas at target (2 waiting each); one stops answering: the 4 the others report
    ask for 2, but the silent one counts as at target (as the HPA counts a pod without
    metrics), so nothing is taken away. For a scale-up it counts as 0."""
    scaler = Autoscaler()
    down = [scaler.decide(t, 3, 4.0, BOUNDS, missing=1).replicas for t in range(0, 130, 10)]
    assert down == [3] * len(down)
    assert run(Autoscaler(), [(t, 4.0) for t in range(0, 130, 10)], current=3)[-1] == 2
    scaler = Autoscaler()
    up = [scaler.decide(t, 1, 6.0, BOUNDS, missing=1).replicas for t in range(0, 12, 2)]
    assert up[-1] == 3  # the 6 reported want 3; the silent one adds nothing


def test_the_reported_metric_is_the_average_over_the_replicas_that_answered() -> None:
    scrape = Scrape({WAITING: 12.0, RUNNING: 3.0}, answered=3, missing=1)
    assert (scrape.metric("queueDepth"), scrape.per_replica("queueDepth")) == (12.0, 4.0)
    assert (scrape.metric("inFlight"), scrape.per_replica("inFlight")) == (15.0, 5.0)


def test_out_of_bounds_is_corrected_at_once() -> None:
    assert Autoscaler().decide(0, 9, None, BOUNDS).replicas == 4
    assert Autoscaler().decide(0, 0, None, BOUNDS).replicas == 1


def test_bounds_are_the_parsed_spec_with_its_defaults() -> None:
    spec = parse_spec(
        {"model": {"source": "hf://a/b"}, "autoscaling": {"enabled": True, "maxReplicas": 4}}
    )
    defaults = AutoscalingSpec()
    assert Bounds.from_spec(spec.autoscaling) == Bounds(
        min_replicas=defaults.min_replicas,
        max_replicas=4,
        metric=defaults.metric,
        target=defaults.target,
        up_window_s=defaults.scale_up_stabilization_seconds,
        down_window_s=defaults.scale_down_delay_seconds,
        idle_s=defaults.scale_to_zero_after_seconds,
    )
    with pytest.raises(ValueError, match="maxReplicas"):
        Bounds.from_spec(AutoscalingSpec(enabled=True))


def test_every_spec_metric_has_engine_gauges() -> None:
    assert tuple(METRICS) == spec_module.METRICS


def test_metric_from_engine_text() -> None:
    # As the engine exports them (kvserve.telemetry.prometheus): labelled by ``model``.
    text = (
        "# HELP kvserve_num_requests_waiting Requests waiting.\n"
        "# TYPE kvserve_num_requests_waiting gauge\n"
        'kvserve_num_requests_waiting{model="a"} 3.0\n'
        "# TYPE kvserve_num_requests_running gauge\n"
        'kvserve_num_requests_running{model="a"} 5.0\n'
    )
    assert metric_from_text(text, METRICS["queueDepth"]) == 3.0
    assert metric_from_text(text, METRICS["inFlight"]) == 8.0


def test_only_ready_pods_with_an_ip_are_scraped() -> None:
    ready = {"type": "Ready", "status": "True"}
    pod = {
        "metadata": {"name": "m-1", "namespace": "ns"},
        "status": {"podIP": "10.0.0.5", "conditions": [ready]},
    }
    assert pod_metrics_url("http://{pod_ip}:8000/metrics", pod) == "http://10.0.0.5:8000/metrics"
    assert pod_metrics_url("{namespace}/{pod_name}", pod) == "ns/m-1"
    unready = {**pod, "status": {"podIP": "10.0.0.5", "conditions": [{**ready, "status": "False"}]}}
    assert pod_metrics_url("x", unready) is None
    assert pod_metrics_url("x", {**pod, "status": {"conditions": [ready]}}) is None


# ---- scale from zero (minReplicas 0): the gateways' held requests and the idle time --------
ZERO = Bounds(
    min_replicas=0,
    max_replicas=3,
    metric="queueDepth",
    target=2,
    up_window_s=10,
    down_window_s=60,
    idle_s=30,
)


def quiet(answered: float = 5) -> Activity:
    return Activity(held=0, answered=answered, in_replicas=0)


def test_a_held_request_scales_from_zero_at_once() -> None:
    scaler = Autoscaler()
    assert scaler.decide(0, 0, None, ZERO, quiet()).replicas == 0
    decision = scaler.decide(2, 0, None, ZERO, Activity(held=2, answered=5, in_replicas=0))
    # No stabilisation window: the requests are waiting for this replica.
    assert decision.replicas == 1 and "held" in decision.reason, decision


def test_without_gateway_metrics_it_stays_where_it_is() -> None:
    scaler = Autoscaler()
    assert scaler.decide(0, 0, None, ZERO, None).replicas == 0
    # At 1 replica, never to zero blindly; the queue rule still never goes below 1.
    assert [scaler.decide(t, 1, 0.0, ZERO, None).replicas for t in range(0, 200, 10)] == [1] * 20


def test_scales_to_zero_after_the_idle_time_without_requests() -> None:
    scaler = Autoscaler()
    replicas = [scaler.decide(t, 1, 0.0, ZERO, quiet()).replicas for t in range(0, 40, 5)]
    assert replicas == [1] * 6 + [0, 0]  # t=30: 30 s since the first look


def test_any_request_restarts_the_idle_time() -> None:
    scaler = Autoscaler()
    busy = {
        10: Activity(held=0, answered=5, in_replicas=1),  # one in a replica
        25: quiet(answered=6),  # one answered since the last look
    }
    replicas = [
        scaler.decide(t, 1, 0.0, ZERO, busy.get(t, quiet(answered=5 if t < 25 else 6))).replicas
        for t in range(0, 60, 5)
    ]
    assert replicas == [1] * 11 + [0]  # idle from t=25: zero at t=55


def test_at_one_replica_the_queue_rule_still_scales_up_and_not_below_one() -> None:
    scaler = Autoscaler()
    queue = Activity(held=0, answered=5, in_replicas=6)
    replicas = [scaler.decide(t, 1, 6.0, ZERO, queue).replicas for t in range(0, 12, 2)]
    assert replicas == [1] * 5 + [3]
    # Queue gone, requests still answered: back down to 1 after the delay, not to 0.
    scaler = Autoscaler()
    down = [
        scaler.decide(t, 3, 0.0, ZERO, Activity(held=0, answered=t, in_replicas=1)).replicas
        for t in range(0, 70, 5)
    ]
    assert down[-1] == 1 and 0 not in down


def test_samples_by_label_from_gateway_text() -> None:
    text = (
        "# TYPE kvserve_gateway_held_requests gauge\n"
        'kvserve_gateway_held_requests{model="a"} 2.0\n'
        'kvserve_gateway_held_requests{model="b"} 7.0\n'
        "# TYPE kvserve_gateway_requests counter\n"
        'kvserve_gateway_requests_total{model="a",status="200"} 3.0\n'
        'kvserve_gateway_requests_total{model="a",status="503"} 1.0\n'
    )
    names = ("kvserve_gateway_held_requests", "kvserve_gateway_requests_total")
    assert samples_from_text(text, names, {"model": "a"}) == {
        "kvserve_gateway_held_requests": 2.0,
        "kvserve_gateway_requests_total": 4.0,
    }
    assert samples_from_text(text, names, {"model": "z"}) == dict.fromkeys(names, 0.0)
