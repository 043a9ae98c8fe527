"""A test-side kubelet for one node: runs the real commands of the pods scheduled there.

kwok fakes every pod on the fake GPU nodes. Pods on ``RUNNER_NODE`` (tainted; a pod asks
for it with a toleration and a nodeSelector on ``RUNNER_LABEL``) are left alone by kwok
(its pod Stages are scoped away from that node, tests/cluster/controlplane.py) and run
here instead, as local processes:

- each pod gets an IP of a /24 that the runner takes from the node's podCIDR
  (198.18.0.0/15, a benchmarking range) and makes local to this machine with
  ``ip route add local NET dev lo`` (so any of its addresses can be bound, as any
  127.x can; loopback addresses themselves are refused in EndpointSlices by the API
  server); this needs CAP_NET_ADMIN (root), and ``stop`` removes the route;
- its volumes are directories under the runner's work directory: emptyDir empty,
  configMap and secret volumes filled with their keys from the API;
- its init containers run in order, each to exit 0, then its containers together; a
  container's ``command`` names one of the images' entry points (``kvserve``,
  ``kvserve-operator``), run from this virtualenv with the pod spec's args and env (literal
  values, ConfigMap and Secret keys, the pod's own fields);
- readiness follows each container's readinessProbe (httpGet or tcpSocket against the pod
  IP); a container whose process exits is reported terminated with its exit code, and the
  pod Succeeded (all 0) or Failed once every container has exited (no restarts);
- a deleted pod runs its containers' preStop sleep, gets SIGTERM, then SIGKILL when its
  grace period is over, and the runner removes the pod object (the kubelet's last step).

Where a real kubelet and container runtime differ (docs/test-cluster.md, "Pods that run"):
no images, namespaces, cgroups or resource limits (processes share this machine); no
real mount points, so a path under a mountPath in the command, args or env, and in a
mounted ConfigMap's files, is rewritten to the volume's directory; a pod has no network
namespace of its own, so ``0.0.0.0`` and ``127.0.0.1`` in those places become the pod IP
(every pod uses the same ports); the ServiceAccount token is a kubeconfig in ``$KUBECONFIG``
rather than files under /var/run/secrets; probes are polled every ``PROBE_INTERVAL``
seconds whatever their periodSeconds; liveness and startup probes, restarts, ``$(VAR)``
expansion and exec probes are not implemented.

Every process is started through tests.support.processes (its output in a temp file, shown
when a test fails) and killed by PID in ``stop``.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import ipaddress
import json
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.cluster.controlplane import RUNNER_LABEL, RUNNER_NODE, RUNNER_POD_CIDR, Cluster
from tests.support.processes import LoggedProcess, start_logged

# Entry points of the images (docker/*.Dockerfile) → the same program from this virtualenv.
ENTRY_POINTS: dict[str, list[str]] = {
    "kvserve": [sys.executable, "-m", "kvserve"],
    "kvserve-operator": [sys.executable, "-m", "kvserve_operator"],
}
POLL_INTERVAL = 0.2  # how often the runner lists its node's pods
PROBE_INTERVAL = 0.5  # how often readiness is probed (tests should not wait periodSeconds)
# The conditions the runner sets; others (PodScheduled, DisruptionTarget) are kept.
OWN_CONDITIONS = frozenset({"Initialized", "Ready", "ContainersReady"})
HOST_IP = "127.0.0.1"  # the node's address, as kwok reports it for every fake node


def scheduling() -> dict[str, Any]:
    """What a pod template needs to land on the runner's node (nodeSelector, tolerations)."""
    return {
        "nodeSelector": {RUNNER_LABEL: "true"},
        "tolerations": [{"key": RUNNER_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
    }


class RunnerUnavailable(RuntimeError):
    """The pod IPs cannot be made local here (no ``ip`` command or no CAP_NET_ADMIN)."""


def _local_routes() -> str:
    return subprocess.run(
        ["ip", "-4", "route", "show", "table", "local"], capture_output=True, text=True
    ).stdout


def take_pod_network() -> ipaddress.IPv4Network:
    """A /24 of RUNNER_POD_CIDR that no other session uses, routed to lo (AnyIP)."""
    if shutil.which("ip") is None:
        raise RunnerUnavailable("the pod runner needs the `ip` command (iproute2)")
    nets = list(ipaddress.IPv4Network(RUNNER_POD_CIDR).subnets(new_prefix=24))
    random.shuffle(nets)  # test sessions running at once each take a /24 of their own
    for net in nets[:20]:
        if str(net.network_address) in _local_routes():
            continue
        proc = subprocess.run(
            ["ip", "route", "add", "local", str(net), "dev", "lo"], capture_output=True, text=True
        )
        if proc.returncode == 0:
            return net
        if "File exists" not in proc.stderr:
            raise RunnerUnavailable(
                f"the pod runner needs CAP_NET_ADMIN (root) to route its pod IPs to lo: "
                f"`ip route add local {net} dev lo`: {proc.stderr.strip()}"
            )
    raise RunnerUnavailable(f"found no free /24 in {RUNNER_POD_CIDR} to route to lo")


def release_pod_network(net: ipaddress.IPv4Network) -> None:
    subprocess.run(["ip", "route", "del", "local", str(net), "dev", "lo"], capture_output=True)


class PodError(RuntimeError):
    """The pod cannot start yet: a ConfigMap, Secret or ServiceAccount is missing (the
    runner retries, as a kubelet does)."""


class NotSupported(RuntimeError):
    """The pod asks for something this runner does not implement: it is reported Failed,
    with this message."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Api:
    """Just the API calls the runner needs, over HTTPS with the admin token."""

    def __init__(self, cluster: Cluster) -> None:
        self.server = cluster.server
        self.token = cluster.token
        self._tls = ssl._create_unverified_context()  # the plane's self-signed serving cert

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            request.add_header("Content-Type", content_type)
        with urllib.request.urlopen(request, timeout=30, context=self._tls) as response:
            return json.loads(response.read() or b"null")

    def get(self, path: str) -> Any:
        return self.call("GET", path)

    def get_or_none(self, path: str) -> Any:
        try:
            return self.get(path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise


@dataclass
class Container:
    """One running (or finished) container of a pod."""

    spec: dict[str, Any]
    proc: LoggedProcess | None = None
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    ready: bool = False
    failures: int = 0  # consecutive readiness failures

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def status(self, init: bool) -> dict[str, Any]:
        state: dict[str, Any]
        if self.exit_code is not None:
            state = {
                "terminated": {
                    "exitCode": self.exit_code,
                    "reason": "Completed" if self.exit_code == 0 else "Error",
                    "startedAt": self.started_at,
                    "finishedAt": self.finished_at,
                }
            }
        elif self.proc is not None:
            state = {"running": {"startedAt": self.started_at}}
        else:
            state = {"waiting": {"reason": "PodInitializing"}}
        return {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.exit_code == 0 if init else self.ready,
            "restartCount": 0,
            "started": self.proc is not None and self.exit_code is None,
            "state": state,
        }


@dataclass
class RunningPod:
    """One pod of the runner's node: its processes, directories and reported status."""

    runner: PodRunner
    pod: dict[str, Any]
    ip: str
    workdir: Path
    deleted: threading.Event = field(default_factory=threading.Event)
    vanished: threading.Event = field(default_factory=threading.Event)
    grace_seconds: float = 30.0
    init: list[Container] = field(default_factory=list)
    main: list[Container] = field(default_factory=list)
    thread: threading.Thread | None = None
    phase: str = "Pending"
    start_time: str = field(default_factory=_now)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def uid(self) -> str:
        return str(self.pod["metadata"]["uid"])

    @property
    def spec(self) -> dict[str, Any]:
        return self.pod["spec"]  # type: ignore[no-any-return]

    # ---- the pod's life -------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # reported on the pod, and in the runner's own log
            self.runner.note(f"{self.namespace}/{self.name}: {exc!r}")
            self.phase = "Failed"
            self._kill_all()
            with contextlib.suppress(Exception):
                self.report(message=str(exc))
        finally:
            if self.deleted.is_set() and not self.vanished.is_set():
                self._remove()

    def _run(self) -> None:
        self.init = [Container(c) for c in self.spec.get("initContainers") or []]
        self.main = [Container(c) for c in self.spec.get("containers") or []]
        self.report()
        launch = self._wait_for(self._prepare)
        if launch is None:
            return
        for c in self.init:
            if self.deleted.is_set():
                return
            self._start(c, *launch[c.name])
            self.report()
            assert c.proc is not None
            while c.exit_code is None and not self.deleted.is_set():
                self._reap(c, timeout=PROBE_INTERVAL)
            if c.exit_code != 0:
                self._kill_all()
                if c.exit_code is not None:
                    self.phase = "Failed"
                    self.report()
                return
            self.report()
        if self.deleted.is_set():
            return
        for c in self.main:
            self._start(c, *launch[c.name])
        self.phase = "Running"
        self.report()
        while not self.deleted.is_set():
            changed = False
            for c in self.main:
                changed |= self._reap(c, timeout=0)
                changed |= self._probe(c)
            if all(c.exit_code is not None for c in self.main):
                self.phase = "Failed" if any(c.exit_code for c in self.main) else "Succeeded"
                self.report()
                return
            if changed:
                self.report()
            self.deleted.wait(PROBE_INTERVAL)
        self._terminate()

    def _wait_for(self, make: Any) -> Any:
        """``make()``, retried while it raises PodError (the kubelet waits for missing
        ConfigMaps, Secrets and ServiceAccounts too); None if the pod is deleted first."""
        while not self.deleted.is_set():
            try:
                return make()
            except PodError as exc:
                self.runner.note(f"{self.namespace}/{self.name} waits: {exc}")
                self.deleted.wait(0.5)
        return None

    def _terminate(self) -> None:
        """Deletion: preStop sleep, SIGTERM, SIGKILL at the end of the grace period."""
        deadline = time.monotonic() + self.grace_seconds
        for c in self.main:
            c.ready = False
        if not self.vanished.is_set():
            with contextlib.suppress(Exception):
                self.report()
        running = [c for c in self.main if c.proc is not None and c.exit_code is None]
        if self.vanished.is_set():  # force-deleted: nothing to report to any more
            deadline = time.monotonic()
        pre_stop = max(
            (
                float(
                    ((c.spec.get("lifecycle") or {}).get("preStop") or {})
                    .get("sleep", {})
                    .get("seconds", 0)
                )
                for c in running
            ),
            default=0.0,
        )
        if pre_stop:
            self.vanished.wait(min(pre_stop, max(0.0, deadline - time.monotonic())))
        for c in running:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        for c in running:
            while c.exit_code is None and time.monotonic() < deadline:
                self._reap(c, timeout=min(PROBE_INTERVAL, max(0.01, deadline - time.monotonic())))
        self._kill_all()

    def _remove(self) -> None:
        """The kubelet's last step: delete the pod object now that its processes are gone."""
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        path = f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"
        try:
            self.runner.api.call("DELETE", path, body)
        except urllib.error.HTTPError as exc:
            if exc.code not in (404, 409):  # gone already, or a new pod of the same name
                raise

    def _kill_all(self) -> None:
        for c in [*self.init, *self.main]:
            if c.proc is not None:
                if c.proc.poll() is None:
                    c.proc.kill()
                self._reap(c, timeout=30)

    def _reap(self, c: Container, timeout: float) -> bool:
        """Record the exit of ``c``'s process if it ended (within ``timeout``); changed?"""
        if c.proc is None or c.exit_code is not None:
            return False
        try:
            code = c.proc.wait(timeout=timeout) if timeout else c.proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return False
        # A signal shows as 128 + its number, as a container runtime reports it.
        c.exit_code = 128 - code if code < 0 else code
        c.finished_at = _now()
        c.ready = False
        self.runner.note(f"{self.namespace}/{self.name}/{c.name} exited {c.exit_code}")
        return True

    # ---- starting a container --------------------------------------------------------

    def _prepare(self) -> dict[str, tuple[list[str], dict[str, str], str]]:
        """Volumes filled, the ServiceAccount's kubeconfig written, and for each container
        its command line, environment and working directory. Raises PodError while
        something it needs is missing (retried by ``_wait_for``)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        volumes: dict[str, Path] = {}
        for vol in self.spec.get("volumes") or []:
            if not {"emptyDir", "configMap", "secret"} & set(vol):
                raise NotSupported(f"volume {vol['name']}: only emptyDir, configMap and secret")
            volumes[vol["name"]] = self.workdir / "volumes" / vol["name"]
            volumes[vol["name"]].mkdir(parents=True, exist_ok=True)
        every_mount = sorted(
            {m for c in [*self.init, *self.main] for m in self._mounts(c, volumes)},
            key=lambda m: -len(m[0]),
        )
        for vol in self.spec.get("volumes") or []:
            if "emptyDir" not in vol:
                self._fill(vol, volumes[vol["name"]], every_mount)
        token_env = self._service_account()
        return {c.name: self._launch(c, volumes, token_env) for c in [*self.init, *self.main]}

    def _fill(self, vol: dict[str, Any], where: Path, mounts: list[tuple[str, Path]]) -> None:
        if "configMap" in vol:
            source = vol["configMap"]
            obj = self._get("configmaps", source["name"])
            data = {k: v.encode() for k, v in (obj or {}).get("data", {}).items()}
        else:
            source = vol["secret"]
            obj = self._get("secrets", source["secretName"])
            data = {k: base64.b64decode(v) for k, v in (obj or {}).get("data", {}).items()}
        if obj is None:
            if source.get("optional"):
                return
            kind = "ConfigMap" if "configMap" in vol else "Secret"
            name = source.get("name") or source.get("secretName")
            raise PodError(f"{kind} {self.namespace}/{name} not found")
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            if item["key"] not in data:
                raise PodError(f"volume {vol['name']}: no key {item['key']!r}")
            target = where / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            content = data[item["key"]]
            if "configMap" in vol:  # config text: see _rewrite
                content = self._rewrite_text(content.decode(), mounts).encode()
            target.write_bytes(content)

    def _get(self, plural: str, name: str) -> dict[str, Any] | None:
        return self.runner.api.get_or_none(  # type: ignore[no-any-return]
            f"/api/v1/namespaces/{self.namespace}/{plural}/{urllib.parse.quote(name)}"
        )

    def _service_account(self) -> dict[str, str]:
        """With a token automounted: a kubeconfig of the pod's ServiceAccount in
        $KUBECONFIG (clients fall back to it: no KUBERNETES_SERVICE_HOST here)."""
        if self.spec.get("automountServiceAccountToken") is False:
            return {}
        sa = self.spec.get("serviceAccountName") or "default"
        path = f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{sa}/token"
        try:
            answer = self.runner.api.call(
                "POST",
                path,
                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                 "spec": {"expirationSeconds": 7200}},
            )  # fmt: skip
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise PodError(f"ServiceAccount {self.namespace}/{sa} not found") from None
            raise
        kubeconfig = self.workdir / "serviceaccount.kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "c",
                            "cluster": {"server": self.runner.api.server,
                                        "insecure-skip-tls-verify": True},
                        }
                    ],
                    "users": [{"name": sa, "user": {"token": answer["status"]["token"]}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": sa,
                                                          "namespace": self.namespace}}],
                    "current-context": "c",
                }
            )
        )  # fmt: skip
        kubeconfig.chmod(0o600)
        return {"KUBECONFIG": str(kubeconfig)}

    def _mounts(self, c: Container, volumes: dict[str, Path]) -> list[tuple[str, Path]]:
        """(mountPath, directory or file here) of ``c``, longest mountPath first."""
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            if m["name"] not in volumes:
                raise NotSupported(f"container {c.name}: no volume {m['name']!r}")
            where = volumes[m["name"]]
            if m.get("subPath"):
                where = where / m["subPath"]
            mounts.append((str(m["mountPath"]).rstrip("/") or "/", where))
        return sorted(mounts, key=lambda m: -len(m[0]))

    def _rewrite(self, value: str, mounts: list[tuple[str, Path]]) -> str:
        """A path under a mountPath → the same path under the volume's directory; the
        addresses a pod binds for itself → its pod IP (no network namespace here)."""
        for mount_path, where in mounts:
            if value == mount_path or value.startswith(mount_path + "/"):
                return str(where) + value[len(mount_path) :]
        return re.sub(r"(?<![\d.])(0\.0\.0\.0|127\.0\.0\.1)(?![\d.])", self.ip, value)

    def _rewrite_text(self, text: str, mounts: list[tuple[str, Path]]) -> str:
        """``_rewrite`` for each path- or address-like token of a mounted config file."""
        return re.sub(r"[^\s\"',:=\[\]{}]+", lambda m: self._rewrite(m.group(0), mounts), text)

    def _env(self, c: Container, mounts: list[tuple[str, Path]]) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in c.spec.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                obj = self._get("configmaps", source["configMapRef"]["name"])
                values = dict((obj or {}).get("data", {}))
            else:
                obj = self._get("secrets", source["secretRef"]["name"])
                values = {
                    k: base64.b64decode(v).decode() for k, v in (obj or {}).get("data", {}).items()
                }
            if obj is None and not (source.get("configMapRef") or source["secretRef"]).get(
                "optional"
            ):
                raise PodError(f"envFrom {source}: not found")
            env.update({prefix + k: v for k, v in values.items()})
        for var in c.spec.get("env") or []:
            if "valueFrom" not in var:
                env[var["name"]] = self._rewrite(str(var.get("value", "")), mounts)
                continue
            value = self._value_from(var["valueFrom"])
            if value is not None:
                env[var["name"]] = value
        return env

    def _value_from(self, ref: dict[str, Any]) -> str | None:
        if "fieldRef" in ref:
            fields = {
                "metadata.name": self.name,
                "metadata.namespace": self.namespace,
                "metadata.uid": self.uid,
                "spec.nodeName": RUNNER_NODE,
                "spec.serviceAccountName": self.spec.get("serviceAccountName", "default"),
                "status.podIP": self.ip,
                "status.hostIP": HOST_IP,
            }
            return str(fields[ref["fieldRef"]["fieldPath"]])
        for kind, plural in (("configMapKeyRef", "configmaps"), ("secretKeyRef", "secrets")):
            if kind in ref:
                key_ref = ref[kind]
                obj = self._get(plural, key_ref["name"])
                data = (obj or {}).get("data", {})
                if key_ref["key"] not in data:
                    if key_ref.get("optional"):
                        return None
                    raise PodError(f"{kind} {key_ref['name']}/{key_ref['key']} not found")
                value = data[key_ref["key"]]
                return base64.b64decode(value).decode() if plural == "secrets" else str(value)
        raise NotSupported(f"env valueFrom {ref}: not implemented by the pod runner")

    def _launch(
        self, c: Container, volumes: dict[str, Path], token_env: dict[str, str]
    ) -> tuple[list[str], dict[str, str], str]:
        """``c``'s command line here, its environment and working directory."""
        mounts = self._mounts(c, volumes)
        command = list(c.spec.get("command") or [])
        if not command or command[0] not in ENTRY_POINTS:
            raise NotSupported(f"container {c.name}: command {command[:1]} is no known entry point")
        args = [self._rewrite(a, mounts) for a in [*command[1:], *(c.spec.get("args") or [])]]
        env = {
            # What an image's environment gives every process (docker/*.Dockerfile).
            "PATH": str(Path(sys.executable).parent) + ":/usr/local/bin:/usr/bin:/bin",
            "HOSTNAME": self.name,
            "PYTHONUNBUFFERED": "1",
            **token_env,
            **self._env(c, mounts),
        }
        cwd = c.spec.get("workingDir")
        return (
            [*ENTRY_POINTS[command[0]], *args],
            env,
            self._rewrite(cwd, mounts) if cwd else str(self.workdir),
        )

    def _start(self, c: Container, argv: list[str], env: dict[str, str], cwd: str) -> None:
        c.started_at = _now()
        c.proc = start_logged(
            argv,
            f"pod-{self.namespace}-{self.name}-{c.name}",
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C of the test run reaches the runner, not these
        )
        self.runner.note(
            f"{self.namespace}/{self.name}/{c.name} pid {c.proc.pid} on {self.ip}: "
            f"{' '.join(argv[3:])} (log {c.proc.log})"
        )

    # ---- probes and status -------------------------------------------------------------

    def _probe(self, c: Container) -> bool:
        """One readiness check of ``c``; whether its readiness changed."""
        if c.proc is None or c.exit_code is not None:
            return False
        probe = c.spec.get("readinessProbe")
        ok = True if probe is None else self._check(c, probe)
        was = c.ready
        if ok:
            c.failures = 0
            c.ready = True
        else:
            c.failures += 1
            if not was or c.failures >= int(probe.get("failureThreshold", 3) if probe else 3):
                c.ready = False
        return was != c.ready

    def _port(self, c: Container, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise NotSupported(f"container {c.name}: no port named {port!r}")

    def _check(self, c: Container, probe: dict[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "httpGet" in probe:
                get = probe["httpGet"]
                conn = http.client.HTTPConnection(
                    get.get("host") or self.ip, self._port(c, get["port"]), timeout=timeout
                )
                try:
                    conn.request("GET", get.get("path", "/"))
                    return 200 <= conn.getresponse().status < 400
                finally:
                    conn.close()
            if "tcpSocket" in probe:
                port = self._port(c, probe["tcpSocket"]["port"])
                with socket.create_connection((self.ip, port), timeout=timeout):
                    return True
        except OSError:
            return False
        raise NotSupported(f"container {c.name}: only httpGet and tcpSocket probes")

    def report(self, message: str | None = None) -> None:
        """Patch the pod's status from the processes (merge patch: lists are replaced)."""
        with self.lock:
            ready = self.phase == "Running" and all(c.ready for c in self.main)
            initialized = all(c.exit_code == 0 for c in self.init)
            now = _now()
            old = {c["type"]: c for c in (self.pod.get("status") or {}).get("conditions") or []}

            def condition(kind: str, status: bool) -> dict[str, Any]:
                value = "True" if status else "False"
                prev = old.get(kind)
                since = prev["lastTransitionTime"] if prev and prev["status"] == value else now
                return {"type": kind, "status": value, "lastTransitionTime": since}

            conditions = [
                *(c for t, c in old.items() if t not in OWN_CONDITIONS),
                condition("Initialized", initialized),
                condition("ContainersReady", ready),
                condition("Ready", ready),
            ]
            status: dict[str, Any] = {
                "phase": self.phase,
                "hostIP": HOST_IP,
                "hostIPs": [{"ip": HOST_IP}],
                "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "startTime": self.start_time,
                "conditions": conditions,
                "initContainerStatuses": [c.status(init=True) for c in self.init],
                "containerStatuses": [c.status(init=False) for c in self.main],
            }
            if message:
                status["message"] = message[:1000]
            path = f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status"
            for attempt in range(5):
                try:
                    updated = self.runner.api.call(
                        "PATCH", path, {"status": status}, "application/merge-patch+json"
                    )
                except urllib.error.HTTPError as exc:
                    if exc.code == 404:  # deleted meanwhile: the poll loop tells the thread
                        return
                    raise
                except (OSError, urllib.error.URLError) as exc:  # a busy API server
                    self.runner.note(f"{self.namespace}/{self.name}: status patch: {exc!r}")
                    time.sleep(0.2 * (attempt + 1))
                    continue
                self.pod["status"] = updated.get("status", status)
                return
            raise PodError("could not report the pod's status 5 times in a row")


class PodRunner:
    """Watches ``RUNNER_NODE``'s pods and runs them (see the module docstring)."""

    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        self.api = Api(cluster)
        self.workdir = workdir
        self.pods: dict[str, RunningPod] = {}  # by uid
        self.log: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.network: ipaddress.IPv4Network | None = None
        self._free_ips: Iterator[ipaddress.IPv4Address] = iter(())

    def note(self, line: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {line}")

    def start(self) -> PodRunner:
        """Take a pod network (RunnerUnavailable if it cannot) and start watching."""
        self.network = take_pod_network()
        self._free_ips = self.network.hosts()
        self._thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and kill every process the runner started, by PID."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for rp in list(self.pods.values()):
            rp.vanished.set()
            rp.deleted.set()
        for rp in list(self.pods.values()):
            if rp.thread is not None:
                rp.thread.join(timeout=30)
            rp._kill_all()
        if self.network is not None:
            release_pod_network(self.network)
            self.network = None

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> list[int]:
        """Signal the running containers of a pod (a crash, not a deletion); their PIDs."""
        pids = []
        for rp in self.find(namespace, name):
            for c in rp.main:
                if c.proc is not None and c.proc.poll() is None:
                    c.proc.send_signal(sig)
                    pids.append(c.proc.pid)
        return pids

    def find(self, namespace: str, name: str) -> list[RunningPod]:
        pods = list(self.pods.values())  # the watch thread may add one meanwhile
        return [rp for rp in pods if (rp.namespace, rp.name) == (namespace, name)]

    def logs(self, namespace: str, name: str) -> str:
        """Every container's output of the named pod(s), titled."""
        return "\n".join(
            c.proc.tail() for rp in self.find(namespace, name) for c in [*rp.init, *rp.main]
            if c.proc is not None
        )  # fmt: skip

    # ---- the watch loop -------------------------------------------------------------

    def _loop(self) -> None:
        selector = urllib.parse.quote(f"spec.nodeName={RUNNER_NODE}")
        while not self._stop.is_set():
            try:
                listed = self.api.get(f"/api/v1/pods?fieldSelector={selector}")["items"]
                self._sync(listed)
            except Exception as exc:  # a busy API server, a pod it failed to remove: go on
                self.note(f"sync failed: {exc!r}")
            self._stop.wait(POLL_INTERVAL)

    def _sync(self, listed: list[dict[str, Any]]) -> None:
        seen = set()
        for pod in listed:
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            rp = self.pods.get(uid)
            deleting = pod["metadata"].get("deletionTimestamp") is not None
            if rp is None:
                if deleting or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                    if deleting:  # not ours to run (e.g. failed before): just remove it
                        self._adopt(pod, run=False)
                    continue
                self._adopt(pod, run=True)
            elif deleting and not rp.deleted.is_set():
                rp.grace_seconds = float(pod["metadata"].get("deletionGracePeriodSeconds") or 0)
                self.note(f"{rp.namespace}/{rp.name} deleted (grace {rp.grace_seconds:.0f} s)")
                rp.deleted.set()
            elif rp.thread is not None and not rp.thread.is_alive() and deleting:
                rp._remove()
        for uid, rp in self.pods.items():
            if uid not in seen and not rp.vanished.is_set():
                self.note(f"{rp.namespace}/{rp.name} is gone from the API: killing it")
                rp.vanished.set()
                rp.deleted.set()

    def _adopt(self, pod: dict[str, Any], run: bool) -> None:
        meta = pod["metadata"]
        ip = str(next(self._free_ips))  # only this (the watch) thread allocates
        workdir = self.workdir / meta["namespace"] / f"{meta['name']}-{meta['uid'][:8]}"
        rp = RunningPod(self, pod, ip, workdir)
        self.pods[meta["uid"]] = rp
        if not run:
            rp.deleted.set()
            rp._remove()
            return
        self.note(f"{rp.namespace}/{rp.name}: starting with IP {ip}")
        rp.thread = threading.Thread(target=rp.run, name=f"pod-{rp.name}", daemon=True)
        rp.thread.start()
