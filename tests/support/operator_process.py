"""The operator as a local process against the real control plane, running as its own
ServiceAccount (a real token from the TokenRequest API, so RBAC is what production gets),
and a feed of engine metrics for its autoscaler.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.cluster.controlplane import Cluster
from tests.support.net import free_port
from tests.support.waiting import poll

MANIFESTS = Path(__file__).resolve().parents[2] / "operator" / "kvserve_operator" / "manifests"
OPERATOR_NS = "kvserve-system"
OPERATOR_SA = "kvserve-operator"


class MetricsFeed:
    """Serves Prometheus text per pod at /NAMESPACE/POD/metrics: the autoscaler's input."""

    def __init__(self) -> None:
        self.waiting: dict[str, float] = {}  # pod name prefix → kvserve_num_requests_waiting
        feed = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                value = next(
                    (v for prefix, v in feed.waiting.items() if parts[1].startswith(prefix)), 0.0
                )
                body = (
                    "# TYPE kvserve_num_requests_waiting gauge\n"
                    f'kvserve_num_requests_waiting{{model="m"}} {value}\n'
                    "# TYPE kvserve_num_requests_running gauge\n"
                    'kvserve_num_requests_running{model="m"} 1.0\n'
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def template(self) -> str:
        return f"http://127.0.0.1:{self.port}/{{namespace}}/{{pod_name}}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class OperatorProcess:
    """``python -m kvserve_operator ARGS`` as a local process with a kubeconfig, on
    loopback ports for /healthz and /metrics; ``start`` returns once /healthz answers."""

    args: list[str]
    kubeconfig: Path
    log_path: Path
    env: dict[str, str]
    feed: MetricsFeed | None = None
    metrics_port: int = field(default_factory=free_port)
    health_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(self.env)
        env["KUBECONFIG"] = str(self.kubeconfig)
        # argparse keeps the last value: these override any ports/bind in ``args``.
        args = [
            *self.args,
            "--metrics-port", str(self.metrics_port), "--health-port", str(self.health_port),
            "--bind", "127.0.0.1",
        ]  # fmt: skip
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve_operator", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            # A parent that ignores SIGINT (make, CI) must not hand that to the operator.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        log.close()

        def healthy() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited: {self.logs()[-3000:]}")
            try:
                return httpx.get(f"http://127.0.0.1:{self.health_port}/healthz").status_code == 200
            except httpx.TransportError:
                return False

        poll("the operator's /healthz", healthy, timeout=60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def install_operator_rbac(cluster: Cluster) -> None:
    """The CRD, the ServiceAccount and the ClusterRole from the manifests, bound together."""
    cluster.kubectl("apply", "--server-side", "-f", str(MANIFESTS / "crd.yaml"))
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/inferencemodels.kvserve.dev", "--timeout=60s"
    )
    cluster.kubectl("create", "namespace", OPERATOR_NS, check=False)
    cluster.kubectl("create", "serviceaccount", OPERATOR_SA, "-n", OPERATOR_NS, check=False)
    cluster.kubectl("apply", "-f", str(MANIFESTS / "rbac.yaml"))
    role = yaml.safe_load((MANIFESTS / "rbac.yaml").read_text())
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "kvserve-operator"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": role["metadata"]["name"],
        },
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": OPERATOR_NS}],
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(binding))
