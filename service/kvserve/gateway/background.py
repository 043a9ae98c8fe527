"""The gateway's background work while it runs: Kubernetes discovery, replica load
polling, and hot reload of the keys file."""

from __future__ import annotations

import asyncio
import logging

from kvserve.gateway.config import parse_replica_url
from kvserve.gateway.discovery import KubernetesDiscovery, Snapshot
from kvserve.gateway.state import GatewayState
from kvserve.gateway.watch import ConfigWatcher

log = logging.getLogger("kvserve.gateway")


def replica_address(url: str) -> str:
    """``host:port`` of a configured replica URL (``grpc://host:port``)."""
    host, port = parse_replica_url(url)
    return f"{host}:{port}"


def start_discovery(state: GatewayState) -> KubernetesDiscovery:
    """Watch the cluster; each snapshot becomes the models' replica sets (static ones kept).
    A discovered model whose Service is gone, and which the config does not name, is
    removed (``Fleet.remove_model``)."""
    cfg = state.config.discovery.kubernetes
    assert cfg is not None
    loop = asyncio.get_running_loop()
    discovered: set[str] = set()

    def apply(snapshot: Snapshot) -> None:
        gone = {m for m in discovered if m not in snapshot and m not in state.config.models}
        for model in sorted(gone):
            state.metrics.remove_model(model, list(state.fleet.replicas.get(model, {})))
            state.fleet.remove_model(model)
        discovered.difference_update(gone)
        for model in sorted(discovered | set(snapshot)):
            settings = state.config.model_settings(model)
            static = [replica_address(url) for url in settings.replicas]
            state.fleet.set_replicas(
                model, [*static, *snapshot.get(model, [])], settings.max_in_flight_per_replica
            )
        discovered.update(snapshot)
        state.update_gauges()

    discovery = KubernetesDiscovery(
        namespaces=cfg.namespaces,
        label_selector=cfg.label_selector,
        port_name=cfg.port_name,
        kubeconfig=cfg.kubeconfig,
        on_change=lambda snapshot: loop.call_soon_threadsafe(apply, snapshot),
    )
    discovery.start()
    return discovery


async def poll_loads(state: GatewayState) -> None:
    while True:
        try:
            await state.fleet.poll_once(timeout=max(state.config.load_poll_seconds, 0.5))
            state.update_gauges()
        except Exception:  # a poll round must never stop polling
            log.exception("replica load poll failed")
        await asyncio.sleep(state.config.load_poll_seconds)


async def watch_keys(state: GatewayState, watcher: ConfigWatcher) -> None:
    while True:
        await asyncio.sleep(state.config.reload_poll_seconds)
        try:
            found = watcher.poll()
        except Exception:
            log.exception("keys file reload failed; keeping the previous keys")
            continue
        if found is None:
            continue
        for error in found.errors:
            log.error("not reloaded, the previous version stays in force: %s", error)
        if found.restart_required:
            log.warning(
                "config changed in fields that need a restart: %s",
                ", ".join(found.restart_required),
            )
        if found.keys is not None:
            state.keys.replace(found.keys)
            state.limiter.update(state.keys.tenants)  # (the watcher logged the reload)
