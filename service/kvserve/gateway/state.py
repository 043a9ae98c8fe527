"""What the gateway's routes and background tasks share: config, keys, limits, replicas."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from opentelemetry import trace

from kvserve.gateway.admission import AdmissionQueue
from kvserve.gateway.auth import KeyStore
from kvserve.gateway.config import GatewayConfig
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.ratelimit import RateLimiter
from kvserve.gateway.replicas import Fleet
from kvserve.gateway.routing import Router
from kvserve.gateway.tenancy import CacheSalts
from kvserve.gateway.watch import ConfigWatcher


@dataclass
class GatewayState:
    config: GatewayConfig
    keys: KeyStore
    limiter: RateLimiter
    fleet: Fleet
    queue: AdmissionQueue
    router: Router
    metrics: GatewayMetrics
    tracer: trace.Tracer
    salts: CacheSalts
    watcher: ConfigWatcher | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    ready: bool = False
    # /v1/models' ``created`` (Unix seconds): when this gateway started.
    created: int = field(default_factory=lambda: int(time.time()))

    def model_names(self) -> list[str]:
        """Models in the config, plus those discovery found replicas for."""
        return sorted(set(self.config.models) | set(self.fleet.models()))

    def serves(self, model: str) -> bool:
        """``model in model_names()``, without building the list (every request asks)."""
        return model in self.config.models or model in self.fleet.replicas

    def update_gauges(self) -> None:
        m = self.metrics
        m.queue_length.set(self.queue.queue_length)
        reaped, self.fleet.reaped = self.fleet.reaped, []
        for model, address in reaped:  # gone: its in-flight series goes too
            m.remove_replica(model, address)
        # A configured model without replicas yet is in ``held`` only.
        held = self.fleet.held
        m.set_held({model: held.get(model, 0) for model in sorted({*self.fleet.models(), *held})})
        for model in self.fleet.models():
            m.add_model(model)
            counts = {"healthy": 0, "unhealthy": 0, "draining": 0}
            for view in self.fleet.views(model):
                m.add_replica(model, self.config.routing.policy, view.address)
                state = "draining" if view.draining else "healthy" if view.healthy else "unhealthy"
                counts[state] += 1
                m.in_flight.labels(model, view.address).set(view.in_flight)
            for state, n in counts.items():
                m.replicas.labels(model, state).set(n)
