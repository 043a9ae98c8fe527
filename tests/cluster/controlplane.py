"""Start and stop a real Kubernetes control plane on 127.0.0.1 for tests and humans.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (which plays the
kubelet for fake GPU nodes, and keeps the pod runner's node alive without touching its
pods: tests/cluster/pod_runner.py) run as local processes built by ``build.py``. Every
process is started in its own session and recorded in ``STATE_DIR/pids.json``; ``stop``
kills exactly those (checking each pid still runs the binary it started) and removes the
directory. Standard library only, plus ``openssl`` for the service-account key.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.net import free_port

try:
    from .build import Binaries, cache_root, ensure_built
except ImportError:  # run as a script from this directory (up, down)
    from build import Binaries, cache_root, ensure_built  # type: ignore[no-redef]

ADMIN_TOKEN_USER = "admin"
GPU_NODES = ("gpu-node-0", "gpu-node-1")
GPUS_PER_NODE = 8
# The node whose pods run for real (tests/cluster/pod_runner.py): kwok keeps its lease and
# status fresh but leaves its pods alone; the taint keeps every pod that does not ask for
# it (tolerate the taint and select the label) on the fake GPU nodes. Its podCIDR is the
# RFC 2544 benchmarking range, not loopback: the API server refuses loopback addresses in
# EndpointSlices. The runner makes a /24 of it local to this machine (docs/test-cluster.md).
RUNNER_NODE = "pod-runner-0"
RUNNER_LABEL = "kvserve.test/pod-runner"
RUNNER_POD_CIDR = "198.18.0.0/15"
STATE_POINTER = "last-cluster"  # file in the cache dir naming the state dir of `up`


class ClusterError(RuntimeError):
    pass


@dataclass
class Cluster:
    """A running control plane: where it lives and how to talk to it."""

    state_dir: Path
    kubeconfig: Path
    server: str
    token: str
    bins: Binaries
    pids: dict[str, int] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = os.pathsep.join([*(str(d) for d in self.bins.bin_dirs), env["PATH"]])
        return env

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.bins.kubectl), *args],
            env=self.env(),
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
        return proc

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path) -> Path:
        """A kubeconfig with a real token of a ServiceAccount (TokenRequest API), so a
        process using it gets exactly that account's RBAC."""
        token = self.kubectl(
            "create", "token", name, "-n", namespace, "--duration=2h"
        ).stdout.strip()
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "c",
                            "cluster": {"server": self.server, "insecure-skip-tls-verify": True},
                        }
                    ],
                    "users": [{"name": name, "user": {"token": token}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": name}}],
                    "current-context": "c",
                }
            )
        )
        path.chmod(0o600)
        return path

    def stop(self) -> None:
        stop(self.state_dir)


def _log(message: str) -> None:
    print(f"[cluster] {message}", file=sys.stderr, flush=True)


def _wait_until(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    proc_names: Sequence[str],
    state_dir: Path,
    pids: dict[str, int],
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in proc_names:
            if not _alive(pids[name]):
                log = (state_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise ClusterError(f"{name} exited while waiting for {what}:\n{log}")
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ValueError, ClusterError):
            pass
        time.sleep(0.2)
    raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}; logs in {state_dir}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our exited child) counts as dead.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _http_ok(url: str, token: str | None = None, expect: str | None = None) -> bool:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl._create_unverified_context() if url.startswith("https") else None  # self-signed
    with urllib.request.urlopen(request, timeout=2, context=context) as response:
        body = response.read().decode()
        return response.status == 200 and (expect is None or expect in body)


def _spawn(name: str, args: list[str], state_dir: Path, pids: dict[str, int]) -> None:
    log = open(state_dir / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # survives `up` exiting; Ctrl-C in a test run does not reach it
        cwd=state_dir,
    )
    log.close()
    pids[name] = proc.pid
    (state_dir / "pids.json").write_text(json.dumps(pids))


def _node_manifest(name: str) -> dict[str, object]:
    capacity = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "nvidia.com/gpu": str(GPUS_PER_NODE),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
            },
        },
        "spec": {},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def _runner_node_manifest() -> dict[str, object]:
    """The pod runner's node: no GPUs, tainted, its own podCIDR (see RUNNER_NODE)."""
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": RUNNER_NODE,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": RUNNER_NODE,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                RUNNER_LABEL: "true",
            },
        },
        "spec": {
            "podCIDR": RUNNER_POD_CIDR,
            "podCIDRs": [RUNNER_POD_CIDR],
            "taints": [{"key": RUNNER_LABEL, "value": "true", "effect": "NoSchedule"}],
        },
        "status": {"capacity": capacity, "allocatable": capacity},
    }


# Added to the selector of every pod Stage: kwok must not mark the runner's pods Ready,
# give them an IP or delete them; the pod runner does all of that from the processes.
_NOT_ON_RUNNER_NODE = f"""    matchExpressions:
    - key: '.spec.nodeName'
      operator: 'NotIn'
      values:
      - '{RUNNER_NODE}'
"""


def kwok_stages(stage_files: Sequence[Path]) -> str:
    """kwok's Stage config: the given Stages, pod Stages scoped away from RUNNER_NODE."""
    docs = []
    for path in stage_files:
        text = path.read_text()
        if "kind: Pod\n" in text:
            if text.count("    matchExpressions:\n") != 1:
                raise ClusterError(f"{path}: expected one selector.matchExpressions to extend")
            text = text.replace("    matchExpressions:\n", _NOT_ON_RUNNER_NODE)
        docs.append(text)
    return "\n---\n".join(docs)


def start(state_dir: Path | None = None, timeout: float = 120.0) -> Cluster:
    """Build (if needed) and start the whole plane; returns once fake GPU nodes are Ready."""
    bins = ensure_built()
    if state_dir is None:
        state_dir = Path(tempfile.mkdtemp(prefix="kvserve-cluster-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    pids: dict[str, int] = {}
    started = time.monotonic()
    try:
        return _start(bins, state_dir, pids, timeout, started)
    except BaseException:
        stop(state_dir)
        raise


def _start(
    bins: Binaries, state_dir: Path, pids: dict[str, int], timeout: float, started: float
) -> Cluster:
    token = os.urandom(16).hex()
    etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
    cm_port, sched_port = free_port(), free_port()
    sa_key = state_dir / "sa.key"
    subprocess.run(
        ["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True
    )
    (state_dir / "tokens.csv").write_text(
        f'{token},{ADMIN_TOKEN_USER},{ADMIN_TOKEN_USER},"system:masters"\n'
    )

    _spawn(
        "etcd",
        [
            str(bins.etcd),
            "--name=kvserve-test",
            f"--data-dir={state_dir / 'etcd'}",
            "--unsafe-no-fsync",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=kvserve-test=http://127.0.0.1:{etcd_peer}",
            "--log-level=warn",
        ],
        state_dir,
        pids,
    )
    _wait_until(
        "etcd",
        lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health", expect='"true"'),
        timeout,
        ["etcd"],
        state_dir,
        pids,
    )

    server = f"https://127.0.0.1:{api_port}"
    _spawn(
        "kube-apiserver",
        [
            str(bins.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}",
            f"--cert-dir={state_dir / 'certs'}",
            f"--token-auth-file={state_dir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa_key}",
            f"--service-account-signing-key-file={sa_key}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            "--disable-admission-plugins=ServiceAccount",
            # As OpenShift runs it: an ownerReference that blocks its owner's deletion
            # needs the right to update the owner's finalizers (the operator's RBAC).
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=1",
        ],
        state_dir,
        pids,
    )
    _wait_until(
        "kube-apiserver /readyz",
        lambda: _http_ok(f"{server}/readyz", token=token),
        timeout,
        ["etcd", "kube-apiserver"],
        state_dir,
        pids,
    )

    kubeconfig = state_dir / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "kvserve-test",
                        "cluster": {"server": server, "insecure-skip-tls-verify": True},
                    }
                ],
                "users": [{"name": "admin", "user": {"token": token}}],
                "contexts": [
                    {
                        "name": "kvserve-test",
                        "context": {"cluster": "kvserve-test", "user": "admin"},
                    }
                ],
                "current-context": "kvserve-test",
            },
            indent=2,
        )
    )
    kubeconfig.chmod(0o600)

    _spawn(
        "kube-controller-manager",
        [
            str(bins.kube_controller_manager),
            f"--kubeconfig={kubeconfig}",
            "--leader-elect=false",
            f"--service-account-private-key-file={sa_key}",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            "--bind-address=127.0.0.1",
            f"--secure-port={cm_port}",
            "--profiling=false",
        ],
        state_dir,
        pids,
    )
    _spawn(
        "kube-scheduler",
        [
            str(bins.kube_scheduler),
            f"--kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={sched_port}",
            "--profiling=false",
        ],
        state_dir,
        pids,
    )
    stages = kwok_stages(sorted(bins.kwok_stages.glob("*.yaml")))
    (state_dir / "kwok.yaml").write_text(stages)
    _spawn(
        "kwok",
        [
            str(bins.kwok),
            f"--kubeconfig={kubeconfig}",
            f"--config={state_dir / 'kwok.yaml'}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--node-ip=127.0.0.1",
            # The heartbeat stage refreshes node status only every 10 minutes and relies on
            # Leases for liveness; without them the node lifecycle controller marks the
            # nodes NotReady after ~40 s and every pod Ready=False, for good.
            "--node-lease-duration-seconds=40",
            "--cidr=10.244.0.0/16",
            f"--server-address=127.0.0.1:{free_port()}",
        ],
        state_dir,
        pids,
    )
    cluster = Cluster(state_dir, kubeconfig, server, token, bins, pids)
    all_procs = list(pids)
    _wait_until(
        "kube-controller-manager and kube-scheduler /healthz",
        lambda: (
            _http_ok(f"https://127.0.0.1:{cm_port}/healthz")
            and _http_ok(f"https://127.0.0.1:{sched_port}/healthz")
        ),
        timeout,
        all_procs,
        state_dir,
        pids,
    )
    items = [*(_node_manifest(n) for n in GPU_NODES), _runner_node_manifest()]
    nodes = {"apiVersion": "v1", "kind": "List", "items": items}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(nodes))
    _wait_until(
        "fake nodes Ready",
        lambda: (
            cluster.kubectl(
                "wait",
                "--for=condition=Ready",
                "node",
                *GPU_NODES,
                RUNNER_NODE,
                "--timeout=1s",
                check=False,
            ).returncode
            == 0
        ),
        timeout,
        all_procs,
        state_dir,
        pids,
    )
    # Pods need a namespace's default ServiceAccount only when that admission plugin is
    # on; it is off, so `default` is usable as soon as the API server is.
    _log(f"control plane ready in {time.monotonic() - started:.1f} s ({state_dir})")
    return cluster


def stop(state_dir: Path) -> None:
    """Stop every process recorded in ``state_dir`` and remove the directory."""
    pids_file = state_dir / "pids.json"
    pids: dict[str, int] = json.loads(pids_file.read_text()) if pids_file.exists() else {}
    for name, pid in pids.items():
        if not _alive(pid):  # died on its own: whatever failed after that starts here
            tail = (state_dir / f"{name}.log").read_text(errors="replace")[-4000:]
            _log(f"{name} had exited before the plane was stopped; its log ends:\n{tail}")
    # Reverse start order, each one gone before the next is signalled: clients first,
    # etcd last. Signalled all at once, kube-apiserver outlived its 10 s because etcd
    # went first (stopping at the session's end took 10 s); in order it exits in ~1 s.
    for name, pid in reversed(list(pids.items())):
        if not (_alive(pid) and _is_ours(pid, state_dir, name)):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid) and _is_ours(pid, state_dir, name):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    shutil.rmtree(state_dir, ignore_errors=True)


def _is_ours(pid: int, state_dir: Path, name: str) -> bool:
    """Guard against pid reuse: the process must be the binary we started, in our dir."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return name in cmdline.split("\0")[0] and Path(cwd) == state_dir.resolve()


def pointer_file() -> Path:
    return cache_root() / STATE_POINTER
