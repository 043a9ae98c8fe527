"""A ``kvserve.bench.stub_replica`` process: the engine's gRPC API with canned output and
no model. Besides the bench, it stands in for a replica that predates a request field
(it reads only what it always did)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvserve.bench.processes import Proc, free_ports, spawn, stop, wait_listening


@contextmanager
def stub_replica(log_dir: Path, step_ms: float = 1.0) -> Iterator[str]:
    """The stub's ``host:port`` while the block runs (its output goes to ``log_dir``);
    ``step_ms``: the time between its output messages."""
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "kvserve.bench.stub_replica", "--port", str(port)]
    argv += ["--step-ms", str(step_ms)]
    proc: Proc = spawn("stub-replica", argv, log_dir / "stub.log", {}, cpus=None)
    try:
        wait_listening(proc, port, time.monotonic() + 60)
        yield f"127.0.0.1:{port}"
    finally:
        stop([proc])
        assert proc.popen.returncode is not None
