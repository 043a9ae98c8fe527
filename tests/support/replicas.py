"""Real engine replicas: ``kvserve serve`` processes with HTTP and gRPC on loopback ports,
as in production. Each keeps its output in a temp file, shown when a test fails."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.net import free_port
from tests.support.processes import LoggedProcess, start_logged
from tests.support.prometheus import metric
from tests.support.waiting import wait_until

REPLICA_MODEL = "tiny"


@dataclass
class Replica:
    proc: LoggedProcess
    http: str
    grpc_port: int

    @property
    def grpc_url(self) -> str:
        return f"grpc://127.0.0.1:{self.grpc_port}"

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.http, name, **labels)

    def stop(self) -> None:
        self.proc.stop()


def start_replicas(model_dir: Path, n: int, *extra: str) -> list[Replica]:
    """``n`` ``kvserve serve`` processes (HTTP + gRPC), started together, once ready."""
    reps = []
    for _ in range(n):
        http_port, grpc_port = free_port(), free_port()
        proc = start_logged(
            [
                sys.executable, "-m", "kvserve", "serve", "--model", str(model_dir),
                "--served-model-name", REPLICA_MODEL, "--port", str(http_port),
                "--grpc-port", str(grpc_port), "--dtype", "float32", "--block-size", "4",
                "--log-level", "warning", *extra,
            ],
            f"replica-{http_port}",
        )  # fmt: skip
        reps.append(Replica(proc, f"http://127.0.0.1:{http_port}", grpc_port))

    def ready(rep: Replica) -> bool:
        if rep.proc.poll() is not None:
            raise RuntimeError(f"replica exited with {rep.proc.returncode}\n{rep.proc.tail()}")
        try:
            return httpx.get(f"{rep.http}/ready").status_code == 200
        except httpx.TransportError:
            return False

    try:
        for rep in reps:
            wait_until(lambda rep=rep: ready(rep), timeout=180)
    except BaseException:
        for rep in reps:
            rep.stop()
        raise
    return reps
