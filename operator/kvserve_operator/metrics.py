"""The operator's own Prometheus metrics (served on ``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()

RECONCILES = Counter(
    "kvserve_operator_reconciles",
    "Reconciles of InferenceModels, by trigger and result (ok, error, gone).",
    ["trigger", "result"],
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    "kvserve_operator_reconcile_errors",
    "Reconciles that failed, by reason (api, spec).",
    ["reason"],
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    "kvserve_operator_reconcile_duration_seconds",
    "Time to render, apply and report one InferenceModel.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
DESIRED_REPLICAS = Gauge(
    "kvserve_operator_desired_replicas",
    "Replicas the operator wants for each InferenceModel (autoscaler decision or spec).",
    ["namespace", "name"],
    registry=REGISTRY,
)
SCALE_EVENTS = Counter(
    "kvserve_operator_scale_events",
    "Autoscaler decisions that changed the replica count, by direction (up, down).",
    ["direction"],
    registry=REGISTRY,
)


def serve(port: int, host: str) -> None:
    start_http_server(port, addr=host, registry=REGISTRY)
