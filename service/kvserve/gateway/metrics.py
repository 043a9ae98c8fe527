"""The gateway's Prometheus metrics (prefix ``kvserve_gateway_``).

Client-side latency is measured as the gateway sees it, with the one definitions module
(docs/architecture.md §3): ``s`` = the request reached the gateway, ``f``/``e`` = the first/last
chunk with visible text was handed to the client's connection.

=================================================== =======================================
Metric                                              Definition
=================================================== =======================================
``kvserve_gateway_requests_total``                  counter by ``model``, ``status`` (HTTP):
                                                    requests the gateway sent on
``kvserve_gateway_rejections_total``                counter by ``reason``: unauthenticated,
                                                    forbidden, rate_limited_requests,
                                                    rate_limited_tokens, concurrency,
                                                    queue_full, queue_timeout,
                                                    no_healthy_replica,
                                                    payload_too_large, invalid (also a
                                                    400 a replica gave: then counted
                                                    under ``requests_total`` too)
``kvserve_gateway_queue_length``                    gauge: requests waiting for a replica
``kvserve_gateway_queue_wait_seconds``              histogram: admission wait (0 if none),
                                                    a hold for a first replica included
``kvserve_gateway_held_requests``                   gauge by ``model``: requests held for a
                                                    model with no replica (scale from zero:
                                                    the operator's demand signal)
``kvserve_gateway_in_flight_requests``              gauge by ``model``, ``replica``
``kvserve_gateway_replicas``                        gauge by ``model``, ``state``: healthy,
                                                    unhealthy, draining
``kvserve_gateway_routing_decisions_total``         counter by ``model``, ``policy``,
                                                    ``replica``
``kvserve_gateway_routing_overrides_total``         counter by ``model``: prefix routes sent
                                                    elsewhere (load bound or retry); LoRA
                                                    requests past the adapter's replicas
``kvserve_gateway_upstream_errors_total``           counter by ``model``, ``code`` (gRPC):
                                                    calls that failed, not a replica's
                                                    refusal of the client's request
``kvserve_gateway_retries_total``                   counter by ``model``
``kvserve_gateway_time_to_first_token_seconds``     histogram by ``model``: TTFT = f − s
``kvserve_gateway_e2e_request_latency_seconds``     histogram by ``model``: E2E = e − s
``kvserve_gateway_client_disconnects_total``        counter by ``model``
``kvserve_gateway_lora_loads_total``                counter by ``model``, ``outcome``:
                                                    loaded, failed (LoRA adapters the
                                                    gateway had a replica load on demand)
=================================================== =======================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.telemetry import definitions as d
from kvserve.telemetry.prometheus import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

REJECTION_REASONS: Final = (
    "unauthenticated",
    "forbidden",
    "rate_limited_requests",
    "rate_limited_tokens",
    "concurrency",
    "queue_full",
    "queue_timeout",
    "no_healthy_replica",
    "payload_too_large",
    "invalid",
)
QUEUE_WAIT_BUCKETS: Final = (
    0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = reg = registry if registry is not None else CollectorRegistry()
        p = "kvserve_gateway_"
        self.requests = Counter(
            p + "requests", "Requests answered, by model and HTTP status.", ("model", "status"),
            registry=reg,
        )  # fmt: skip
        self.rejections = Counter(
            p + "rejections", "Requests refused before reaching a replica, by reason.",
            ("reason",), registry=reg,
        )  # fmt: skip
        for reason in REJECTION_REASONS:  # every reason shows, at 0, from the start
            self.rejections.labels(reason)
        self.queue_length = Gauge(
            p + "queue_length", "Requests waiting for a replica.", registry=reg
        )
        self.queue_wait = Histogram(
            p + "queue_wait_seconds", "Admission wait before a replica slot (0 if none).",
            buckets=QUEUE_WAIT_BUCKETS, registry=reg,
        )  # fmt: skip
        self.held = Gauge(
            p + "held_requests",
            "Requests held for a model that has no replica (scaled to zero), by model.",
            ("model",), registry=reg,
        )  # fmt: skip
        self._held_models: set[str] = set()  # the models set_held gave a series
        self.in_flight = Gauge(
            p + "in_flight_requests", "Requests sent to a replica and not yet finished.",
            ("model", "replica"), registry=reg,
        )  # fmt: skip
        self.replicas = Gauge(
            p + "replicas", "Replicas by state.", ("model", "state"), registry=reg
        )
        self.routing = Counter(
            p + "routing_decisions", "Replica choices, by policy and replica.",
            ("model", "policy", "replica"), registry=reg,
        )  # fmt: skip
        self.overrides = Counter(
            p + "routing_overrides",
            "Prefix routes sent to another replica than the ring's first choice (load bound or "
            "retry).",
            ("model",), registry=reg,
        )  # fmt: skip
        self.upstream_errors = Counter(
            p + "upstream_errors", "Failed gRPC calls to replicas, by status code.",
            ("model", "code"), registry=reg,
        )  # fmt: skip
        self.retries = Counter(
            p + "retries", "Requests re-sent to another replica before any output.", ("model",),
            registry=reg,
        )  # fmt: skip
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "TTFT as the gateway sees it: f - s.", ("model",),
            buckets=TTFT_BUCKETS, registry=reg,
        )  # fmt: skip
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "E2E as the gateway sees it: e - s.", ("model",),
            buckets=REQUEST_LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.disconnects = Counter(
            p + "client_disconnects", "Clients that went away before their answer ended.",
            ("model",), registry=reg,
        )  # fmt: skip

        self.lora_loads = Counter(
            p + "lora_loads", "LoRA adapters loaded on a replica on demand, by outcome.",
            ("model", "outcome"), registry=reg,
        )  # fmt: skip

    def add_model(self, model: str) -> None:
        """Create the model's counters (and latency histograms) at 0, so ``rate()`` sees
        their first increment (a series that appears at 1 has no earlier sample to rise
        from), and a dashboard panel of them reads 0, not "No data"."""
        for metric in (self.overrides, self.retries, self.disconnects, self.ttft, self.e2e):
            metric.labels(model)
        self.requests.labels(model, "200")

    def set_held(self, counts: Mapping[str, int]) -> None:
        """``held_requests`` of exactly these models: one that is no longer among them (it
        was removed, and its last held request has ended) loses its series."""
        for model in self._held_models - counts.keys():
            self.held.remove(model)
        for model, n in counts.items():
            self.held.labels(model).set(n)
        self._held_models = set(counts)

    def remove_model(self, model: str, replicas: Iterable[str]) -> None:
        """Drop a removed model's gauges (replicas by state, in-flight by replica), so no
        dashboard shows replicas of a model that is gone; its counters stay."""
        for state in ("healthy", "unhealthy", "draining"):
            self.replicas.remove(model, state)  # a series never set: nothing happens
        for replica in replicas:
            self.in_flight.remove(model, replica)

    def remove_replica(self, model: str, replica: str) -> None:
        """Drop a forgotten replica's in-flight gauge (a stale series would read its last
        count for ever); its counters stay."""
        with contextlib.suppress(KeyError):  # never set
            self.in_flight.remove(model, replica)

    def add_replica(self, model: str, policy: str, replica: str) -> None:
        self.routing.labels(model, policy, replica)

    def observe_timeline(self, model: str, s: float, f: float | None, e: float | None) -> None:
        """One finished request's client-side TTFT and E2E (when it showed any text)."""
        if f is not None:
            self.ttft.labels(model).observe(d.ttft(s, f))
        if e is not None:
            self.e2e.labels(model).observe(d.e2e(s, e))

    def render(self) -> bytes:
        return generate_latest(self.registry)
