"""Kubernetes replica discovery: EndpointSlices of the Services that carry a label.

The operator gives every InferenceModel's Service the label
``app.kubernetes.io/managed-by=kvserve-operator`` and the annotation
``kvserve.dev/served-name`` (what clients send as ``"model"``); the EndpointSlice
controller copies the Service's labels onto its slices. So the gateway lists and
watches two things with one label selector — Services (for the served name) and
EndpointSlices (for the ready pod addresses) — and hands the fleet a snapshot
``served name → ["ip:grpc-port", ...]`` whenever it changes. A pod that stops being
ready (or starts terminating) leaves the snapshot, and the fleet drains it. A Service
whose served name breaks the rule of model names (``kvserve.names``: one printable word,
not ``*``) is left out, with a warning. Services that carry the same served name (in
one namespace or several) are one model, their replicas pooled: a second deployment of
a model adds replicas to it (warned about, as a fine-tune given another's name would be
mixed in the same way).

The watches run in threads (the Kubernetes client is synchronous); ``on_change`` is
called from those threads, one at a time and in the order the snapshots were taken, so
callers hop back to their event loop themselves, and must not block.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from kvserve.names import model_name_problem

log = logging.getLogger("kvserve.gateway.discovery")

SERVED_NAME_ANNOTATION = "kvserve.dev/served-name"
# Client-side bounds on the API server's answers (seconds).
CONNECT_TIMEOUT_SECONDS = 10
LIST_TIMEOUT_SECONDS = 60
WATCH_SILENCE_MARGIN_SECONDS = 30  # past the watch's own timeout_seconds
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

Snapshot = dict[str, list[str]]  # served model name → sorted "host:port"


def slice_addresses(endpoint_slice: Mapping[str, Any], port_name: str) -> list[str]:
    """``host:port`` of the slice's ready endpoints on the named port."""
    port = next(
        (p.get("port") for p in endpoint_slice.get("ports") or [] if p.get("name") == port_name),
        None,
    )
    if port is None:
        return []
    ipv6 = endpoint_slice.get("addressType") == "IPv6"
    out = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        # The API says an unset `ready` means ready; terminating pods are never ready.
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        for address in (endpoint.get("addresses") or [])[:1]:  # all addresses are one pod
            out.append(f"[{address}]:{port}" if ipv6 else f"{address}:{port}")
    return out


def served_name(service: Mapping[str, Any], annotation: str = SERVED_NAME_ANNOTATION) -> str:
    meta = service.get("metadata") or {}
    return str((meta.get("annotations") or {}).get(annotation) or meta.get("name"))


class DiscoveryState:
    """Services and slices seen so far; pure, so the snapshot logic is easy to test."""

    def __init__(self, port_name: str, annotation: str = SERVED_NAME_ANNOTATION) -> None:
        self.port_name = port_name
        self.annotation = annotation
        self.services: dict[tuple[str, str], str] = {}  # (namespace, name) → served name
        self.slices: dict[tuple[str, str], tuple[str, list[str]]] = {}  # → (service, addresses)

    def apply(self, kind: str, event_type: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if kind == "Service":
            name = served_name(obj, self.annotation)
            problem = model_name_problem(name, "served model name")
            if problem is not None and event_type != "DELETED":
                log.warning("Service %s/%s left out: %s", *key, problem)
            if event_type == "DELETED" or problem is not None:
                self.services.pop(key, None)
            else:
                self.services[key] = name
        else:
            if event_type == "DELETED":
                self.slices.pop(key, None)
            else:
                service = str((meta.get("labels") or {}).get(SERVICE_NAME_LABEL, ""))
                self.slices[key] = (service, slice_addresses(obj, self.port_name))

    def replace(self, kind: str, objects: list[Mapping[str, Any]], namespace: str | None) -> None:
        """A fresh list replaces what was known for that kind (and namespace)."""
        table: dict[tuple[str, str], Any] = self.services if kind == "Service" else self.slices
        for key in [k for k in table if namespace is None or k[0] == namespace]:
            del table[key]
        for obj in objects:
            self.apply(kind, "ADDED", obj)

    def snapshot(self) -> Snapshot:
        # Every Service's model is in it, with or without ready endpoints: a model scaled
        # to zero is still served here (its requests are held until a replica comes).
        models: dict[str, set[str]] = {model: set() for model in self.services.values()}
        for (namespace, _), (service, addresses) in self.slices.items():
            model = self.services.get((namespace, service))
            if model is not None:
                models.setdefault(model, set()).update(addresses)
        return {model: sorted(addresses) for model, addresses in sorted(models.items())}

    def shared_names(self) -> dict[str, list[str]]:
        """Served names that more than one Service carries (``namespace/name`` of each):
        one model to the gateway, whose replicas are pooled."""
        services: dict[str, list[str]] = {}
        for (namespace, name), model in sorted(self.services.items()):
            services.setdefault(model, []).append(f"{namespace}/{name}")
        return {model: found for model, found in services.items() if len(found) > 1}


class KubernetesDiscovery:
    """List-and-watch threads feeding a ``DiscoveryState``; calls ``on_change`` on changes."""

    def __init__(
        self,
        *,
        namespaces: list[str],
        label_selector: str,
        port_name: str,
        on_change: Callable[[Snapshot], object],
        kubeconfig: Path | None = None,
        watch_timeout_seconds: int = 60,
    ) -> None:
        from kubernetes import client, config

        if kubeconfig is not None:
            config.load_kube_config(config_file=str(kubeconfig))
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
        self._api = client.ApiClient()
        if not self._api.configuration.verify_ssl:
            import urllib3

            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        self.namespaces: list[str | None] = list(namespaces) or [None]
        self.label_selector = label_selector
        self.state = DiscoveryState(port_name)
        self.on_change = on_change
        self.watch_timeout_seconds = watch_timeout_seconds
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: set[Any] = set()  # kubernetes.watch.Watch objects streaming now
        self._last: Snapshot | None = None
        self._shared: dict[str, list[str]] = {}  # warned about (shared_names)

    def start(self) -> None:
        for namespace in self.namespaces:
            for kind in ("Service", "EndpointSlice"):
                thread = threading.Thread(
                    target=self._run,
                    args=(kind, namespace),
                    name=f"discovery-{kind}-{namespace or 'all'}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
        # A thread blocked reading a watch sees the stop only when an event or the
        # watch's timeout comes: Watch.stop() (kubernetes >= 37) shuts its socket
        # down, which ends the read at once. Stopped again until the thread ends: a
        # watch stopped while its request was still being sent has no socket to shut
        # yet. The deadline is for a thread in a list call; the threads are daemons, so
        # waiting longer would only delay the gateway's exit.
        deadline = time.monotonic() + 5
        for thread in self._threads:
            while thread.is_alive() and time.monotonic() < deadline:
                with self._lock:
                    watches = list(self._watches)
                for w in watches:
                    w.stop()
                thread.join(timeout=0.1)

    def _list_fn(self, kind: str, namespace: str | None) -> Callable[..., Any]:
        from kubernetes import client

        # Always a lambda: the watch then yields plain dicts (it cannot find a model type
        # to deserialize into), which is all this module reads.
        if kind == "Service":
            core = client.CoreV1Api(self._api)
            if namespace is None:
                return lambda **kw: core.list_service_for_all_namespaces(**kw)
            return lambda **kw: core.list_namespaced_service(namespace, **kw)
        disc = client.DiscoveryV1Api(self._api)
        if namespace is None:
            return lambda **kw: disc.list_endpoint_slice_for_all_namespaces(**kw)
        return lambda **kw: disc.list_namespaced_endpoint_slice(namespace, **kw)

    def _run(self, kind: str, namespace: str | None) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                for _ in self._list_and_watch(kind, namespace):
                    backoff = 0.5
                    if self._stop.is_set():
                        return
            except Exception as exc:  # network, 410 Gone, auth: relist after a pause
                if self._stop.is_set():
                    return
                log.warning(
                    "watching %s in %s failed (%s); relisting",
                    kind,
                    namespace or "all namespaces",
                    exc,
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _list_and_watch(self, kind: str, namespace: str | None) -> Iterator[None]:
        from kubernetes import watch

        list_fn = self._list_fn(kind, namespace)
        listed = list_fn(
            label_selector=self.label_selector,
            _preload_content=False,
            _request_timeout=(CONNECT_TIMEOUT_SECONDS, LIST_TIMEOUT_SECONDS),
        )
        body = json.loads(listed.data)
        with self._lock:
            self.state.replace(kind, body.get("items") or [], namespace)
        self._publish()
        yield
        version = body["metadata"]["resourceVersion"]
        while True:
            w = watch.Watch()
            with self._lock:  # stop() either sees this watch or is seen here
                if self._stop.is_set():
                    return
                self._watches.add(w)
            try:
                stream = w.stream(
                    list_fn,
                    label_selector=self.label_selector,
                    resource_version=version,
                    timeout_seconds=self.watch_timeout_seconds,
                    allow_watch_bookmarks=True,
                    # The server ends the watch at timeout_seconds; a connection silent
                    # for longer has gone dead under us (a load balancer's failover, a
                    # dropped conntrack entry): give up on it and relist, rather than
                    # wait on it for ever with the fleet frozen.
                    _request_timeout=(
                        CONNECT_TIMEOUT_SECONDS,
                        self.watch_timeout_seconds + WATCH_SILENCE_MARGIN_SECONDS,
                    ),
                )
                for event in stream:
                    obj = event["raw_object"]
                    if event["type"] == "ERROR":
                        raise RuntimeError(f"watch error: {obj.get('message')}")
                    version = obj["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        with self._lock:
                            self.state.apply(kind, event["type"], obj)
                        self._publish()
                    yield
                    if self._stop.is_set():
                        return
            finally:
                with self._lock:
                    self._watches.discard(w)

    def _publish(self) -> None:
        with self._lock:
            snapshot = self.state.snapshot()
            if snapshot == self._last:
                return
            self._last = snapshot
            shared, before = self.state.shared_names(), self._shared
            self._shared = shared
            # Delivered under the lock (on_change only schedules the update on the
            # gateway's loop), so the watch threads' snapshots arrive in the order they
            # were taken: the last one delivered is the latest, never an older one that
            # lost a race to the loop.
            self.on_change(snapshot)
        log.info("discovered replicas: %s", snapshot)
        for model, services in shared.items():
            if before.get(model) == services:
                continue  # already said
            log.warning(
                "served name %r is on %d Services (%s): their replicas are pooled as one model",
                model,
                len(services),
                ", ".join(services),
            )
