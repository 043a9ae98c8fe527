"""LoRA adapters behind the gateway: which model a name belongs to, and loading one on a
replica on demand.

A request's ``model`` names a model or one of its adapters. The adapters the gateway
knows are those the model's replicas report serving (``GetLoad``) and those listed in
the config's ``models.<name>.lora_adapters``; any other name is a 404. Routing prefers
the replicas that serve the adapter (``route_adapter`` below); when
none can take the request, the least loaded replica is asked to load it by name, which a
replica reads from ``<its --lora-dir>/<name>`` (docs/gateway-config.md, "LoRA adapters").

Requests that route to a replica while the gateway is loading the same adapter there
wait for that one load instead of starting their own: the load is a task per replica and
adapter, shielded from the cancellation of any one waiting request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence

import grpc

from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.replicas import Replica
from kvserve.gateway.routing import (
    DEFAULT_LOAD_FACTOR,
    ReplicaLoad,
    RouteDecision,
    Router,
    eligible,
    load_bound,
)
from kvserve.gateway.state import GatewayState

log = logging.getLogger("kvserve.gateway")


class AdapterLoadFailed(Exception):
    """The replica did not load the adapter; ``code`` is the load call's gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode | None) -> None:
        super().__init__(message)
        self.code = code


def resolve(state: GatewayState, name: str) -> tuple[str, str | None] | None:
    """``(model, adapter)`` for a request's ``model`` field: ``(name, None)`` for a model,
    ``(its model, name)`` for a known adapter, ``None`` for neither."""
    if state.serves(name):
        return name, None
    model = state.config.adapter_model(name) or state.fleet.adapter_base(name)
    return (model, name) if model is not None else None


def known(state: GatewayState, model: str) -> list[str]:
    """The adapter names of ``model``: configured, or served by one of its replicas."""
    configured = state.config.model_settings(model).lora_adapters
    return sorted(set(configured) | state.fleet.adapters(model))


async def ensure_loaded(
    state: GatewayState, model: str, replica: Replica, name: str, timeout: float
) -> None:
    """Return once ``replica`` serves the adapter ``name``, loading it if this gateway is
    not already doing so; raises ``AdapterLoadFailed``."""
    if name in replica.lora_adapters:
        return
    task = replica.loading.get(name)
    if task is None:
        task = asyncio.create_task(_load(replica, name, timeout, state.metrics, model))
        replica.loading[name] = task
        task.add_done_callback(lambda done: _loaded(replica, name, done))
    await asyncio.shield(task)


def _loaded(replica: Replica, name: str, task: asyncio.Task[None]) -> None:
    replica.loading.pop(name, None)
    if not task.cancelled():
        task.exception()  # retrieved: every request that waited for it may have left


def serving(state: GatewayState, model: str) -> bool:
    """Whether a routable replica of ``model`` has LoRA on (reported by its last poll)."""
    return any(view.routable and view.lora_slots > 0 for view in state.fleet.views(model))


async def _load(
    replica: Replica, name: str, timeout: float, metrics: GatewayMetrics, model: str
) -> None:
    try:
        await replica.client.load_lora_adapter(name, timeout)
    except grpc.aio.AioRpcError as exc:
        # Another gateway (or an operator) may have loaded it since our last poll: the
        # replica then refuses a second load of the name. Ask before calling it a failure.
        if not await _serves(replica, name, timeout):
            metrics.lora_loads.labels(model, "failed").inc()
            log.warning(
                "replica %s did not load LoRA adapter %r: %s", replica.address, name, exc.details()
            )
            raise AdapterLoadFailed(
                f"replica {replica.address} could not load adapter {name!r}: {exc.details()}",
                exc.code(),
            ) from None
    else:
        metrics.lora_loads.labels(model, "loaded").inc()
        log.info("replica %s loaded LoRA adapter %r", replica.address, name)
    replica.lora_adapters = replica.lora_adapters | {name}


async def _serves(replica: Replica, name: str, timeout: float) -> bool:
    try:
        load = await replica.client.get_load(timeout)
    except grpc.aio.AioRpcError:
        return False
    replica.lora_adapters = frozenset(load.lora_adapters)
    return name in replica.lora_adapters


def forget(replica: Replica, name: str) -> None:
    """The replica answered that it does not serve ``name`` (unloaded since the last poll)."""
    replica.lora_adapters = replica.lora_adapters - {name}


def route_adapter(
    router: Router,
    adapter: str,
    key: str,
    replicas: Sequence[ReplicaLoad],
    exclude: Collection[str] = (),
    load_factor: float = DEFAULT_LOAD_FACTOR,
) -> RouteDecision | None:
    """Where a request for the LoRA ``adapter`` goes (``None``: no replica can take it now).

    The replicas that serve the adapter come first, chosen among by the policy's
    ``router``, but only those within ``routing.load_bound`` over *all* the model's replicas:
    the rule of prefix routing, so a hot adapter spills onto other replicas (which then
    load it too) instead of overloading its holders. Otherwise, the least loaded eligible
    replica with LoRA on (fewest in-flight + waiting; a holder first on a tie, then by
    address), with ``load_adapter`` set when it does not serve the adapter yet.
    """
    bound = load_bound(replicas, load_factor)
    holders = [
        replica
        for replica in replicas
        if adapter in replica.adapters
        and eligible(replica, exclude)
        and replica.in_flight + 1 <= bound
    ]
    if holders:
        decision = router.route(key, holders, exclude)
        if decision is not None:
            return RouteDecision(decision.address, overridden=decision.overridden)
    candidates = [
        replica for replica in replicas if replica.lora_slots > 0 and eligible(replica, exclude)
    ]
    if not candidates:
        return None
    least = min(
        candidates,
        key=lambda r: (r.in_flight + r.waiting, adapter not in r.adapters, r.address),
    )
    load = adapter if adapter not in least.adapters else None
    return RouteDecision(least.address, overridden=True, load_adapter=load)
