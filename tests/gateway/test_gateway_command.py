"""``kvserve gateway``'s command line refuses what it cannot serve with one line and
status 2, before it starts anything: a log level it does not know, and a host or port it
could not listen on (as ``kvserve serve`` does, with the same check: kvserve.ports)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gateway import gateway_command
from tests.support.net import free_port

# Never connected to: every refusal comes before the gateway reaches for its replicas.
REPLICA_URL = "grpc://127.0.0.1:1"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port something listens on while the test runs."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


def refusal(command: list[str]) -> str:
    """The stderr of a command that must be refused as a usage error (status 2), at once."""
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, f"status {out.returncode}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    assert "gateway on http" not in out.stderr, out.stderr  # refused before it started
    return out.stderr


def test_an_unknown_log_level_is_a_usage_error(tmp_path: Path) -> None:
    kvserve = gateway_command(tmp_path, f"{{port: {free_port()}}}", REPLICA_URL)
    stderr = refusal([*kvserve, "--log-level", "LOUD"])
    assert "argument --log-level: invalid choice" in stderr, stderr


def test_a_port_in_use_is_one_line(tmp_path: Path, taken_port: int) -> None:
    kvserve = gateway_command(tmp_path, f"{{port: {taken_port}}}", REPLICA_URL)
    stderr = refusal(kvserve)
    assert f"kvserve gateway: error: cannot listen on 127.0.0.1:{taken_port}: " in stderr
    assert "Address already in use" in stderr and "listen.port" in stderr, stderr

    # The same port given as --port, and as the metrics port.
    kvserve = gateway_command(tmp_path, f"{{port: {free_port()}}}", REPLICA_URL)
    stderr = refusal([*kvserve, "--port", str(taken_port)])
    assert f"cannot listen on 127.0.0.1:{taken_port}: Address already in use" in stderr, stderr
    stderr = refusal([*kvserve, "--metrics-port", str(taken_port)])
    assert f"cannot listen on 127.0.0.1:{taken_port}: Address already in use" in stderr, stderr
    assert "--metrics-port" in stderr, stderr


def test_a_host_that_is_no_address_here_is_one_line(tmp_path: Path) -> None:
    port = free_port()
    kvserve = gateway_command(tmp_path, f"{{port: {port}}}", REPLICA_URL)
    stderr = refusal([*kvserve, "--host", "999.1.1.1"])
    assert f"kvserve gateway: error: cannot listen on 999.1.1.1:{port}: " in stderr, stderr
