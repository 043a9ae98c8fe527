"""The servers a benchmark starts (replicas, stub replicas, gateways on 127.0.0.1), each
with its output in a log file, all stopped together when the ``with`` ends."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.bench.processes import Proc, free_ports, spawn, stop, wait_listening, wait_ready
from kvserve.bench.sse_client import MODEL_NAME
from kvserve.telemetry.request_log import REQUEST_LOGGER

if TYPE_CHECKING:
    import httpx
    from prometheus_client.samples import Sample


@dataclass(frozen=True)
class LaunchSettings:
    """How the replicas and gateways of one benchmark run are configured. An engine
    setting left None is the engine's default."""

    model: str  # checkpoint directory
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    startup_timeout: float = 300.0  # seconds for a process to be ready
    # The gateway's per-replica in-flight cap and admission queue: never the bottleneck,
    # or a comparison measures the queue (at least the streams a benchmark opens).
    gateway_in_flight: int = 256
    gateway_queue: int = 256


# The settings above that are engine settings.
ENGINE_FLAGS = "dtype device seed max_num_seqs max_model_len block_size max_num_batched_tokens"


@dataclass
class Replica:
    proc: Proc
    http_url: str
    grpc_port: int | None  # None: started without its gRPC API

    @property
    def grpc_address(self) -> str:
        """``host:port`` of its gRPC API, as the gateway's config and metrics name it."""
        if self.grpc_port is None:
            raise ValueError(f"{self.proc.name} serves no gRPC API")
        return f"127.0.0.1:{self.grpc_port}"

    def request_log(self) -> dict[str, dict[str, Any]]:
        """Its request log (at log level info) by request id; empty where the engine's
        clock is not the client's, so that their instants could not be subtracted."""
        return read_request_log(self.proc.log) if same_clock() else {}


@dataclass
class Gateway:
    proc: Proc
    url: str
    key: str  # the one API key it accepts (no limits)


@dataclass
class Launcher:
    """Starts the servers of one benchmark run, with their logs and configuration files
    in ``workdir``, and stops every one it started."""

    settings: LaunchSettings
    workdir: Path
    started: list[Proc] = field(default_factory=list)

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        stop(self.started)

    def start_replicas(
        self,
        n: int,
        *,
        prefix_caching: bool = True,
        grpc: bool = True,
        threads: int | None = None,
        cpus: frozenset[int] | None = None,
        log_level: str = "warning",
        extra_flags: Sequence[str] = (),
    ) -> list[Replica]:
        """``n`` replicas started together (on ``cpus`` when given, with ``threads``
        OpenMP threads unless the caller set OMP_NUM_THREADS, and ``extra_flags`` for
        `kvserve serve`); returns once every one answers /ready. At ``log_level`` info
        their logs hold the request log."""
        s = self.settings
        flags: list[str] = []
        for name in ENGINE_FLAGS.split():  # each a `kvserve serve` flag of the same name
            if (value := getattr(s, name)) is not None:
                flags += [f"--{name.replace('_', '-')}", str(value)]
        if not prefix_caching:
            flags.append("--no-prefix-caching")
        flags += extra_flags
        reps: list[Replica] = []
        for _ in range(n):
            http_port, grpc_port = free_ports(2)
            argv = [
                sys.executable, "-m", "kvserve", "serve", "--model", s.model,
                "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
                "--port", str(http_port), *flags, "--drain-timeout", "2",
                "--log-level", log_level,
                *(["--grpc-port", str(grpc_port)] if grpc else ["--no-grpc"]),
            ]  # fmt: skip
            proc = self._spawn(self._name("replica"), argv, threads, cpus)
            reps.append(Replica(proc, f"http://127.0.0.1:{http_port}", grpc_port if grpc else None))
        deadline = time.monotonic() + s.startup_timeout
        for rep in reps:
            wait_ready(rep.proc, f"{rep.http_url}/ready", deadline)
        return reps

    def start_stub_replica(self, cpus: frozenset[int] | None = None) -> str:
        """A stub replica (``bench.stub_replica``) on ``cpus``; returns its gRPC address
        once it listens."""
        (port,) = free_ports(1)
        argv = [sys.executable, "-m", "kvserve.bench.stub_replica", "--port", str(port)]
        proc = self._spawn(self._name("stub-replica"), argv, None, cpus)
        wait_listening(proc, port, time.monotonic() + self.settings.startup_timeout)
        return f"127.0.0.1:{port}"

    def start_gateway(
        self, addresses: Sequence[str], policy: str, cpus: frozenset[int] | None = None
    ) -> Gateway:
        """A gateway for the replicas at ``addresses`` (gRPC ``host:port``) with routing
        ``policy``, on ``cpus`` when given; returns once it can route to every replica."""
        import yaml

        from kvserve.gateway.keys import new_key

        (port,) = free_ports(1)
        name = self._name("gateway")
        key, digest = new_key()
        keys_path = self.workdir / f"{name}-keys.yaml"
        config_path = self.workdir / f"{name}.yaml"
        # One key, no rate limits (null = unlimited), highest priority.
        entry = {"tenant": "bench", "sha256": digest, "models": ["*"], "priority": "critical"}
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "models": {
                MODEL_NAME: {
                    "replicas": [f"grpc://{address}" for address in addresses],
                    "max_in_flight_per_replica": self.settings.gateway_in_flight,
                }
            },
            "routing": {"policy": policy},
            "admission": {"queue_size": self.settings.gateway_queue},
            "keys_file": keys_path.name,
        }
        keys_path.write_text(yaml.safe_dump({"keys": [entry]}))
        config_path.write_text(yaml.safe_dump(config))
        argv = [
            sys.executable, "-m", "kvserve", "gateway", "--config", str(config_path),
            "--log-level", "warning",
        ]  # fmt: skip
        proc = self._spawn(name, argv, None, cpus)
        url = f"http://127.0.0.1:{port}"

        def all_routable(r: httpx.Response) -> bool:
            return bool(r.json().get("replicas", {}).get(MODEL_NAME) == len(addresses))

        deadline = time.monotonic() + self.settings.startup_timeout
        wait_ready(proc, f"{url}/ready", deadline, all_routable)
        return Gateway(proc, url, key)

    def _name(self, kind: str) -> str:
        return f"{kind}-{len(self.started) + 1}"

    def _spawn(
        self, name: str, argv: list[str], threads: int | None, cpus: frozenset[int] | None
    ) -> Proc:
        env = dict(os.environ)
        if threads is not None and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(threads)
        proc = spawn(name, argv, self.workdir / f"{name}.log", env, cpus)
        self.started.append(proc)
        return proc


def metric_samples(url: str) -> list[Sample]:
    """Every sample a server (replica or gateway at ``url``) exports on /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=60).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def read_request_log(log: Path) -> dict[str, dict[str, Any]]:
    """The request-log records (``kvserve.telemetry.request_log``) among a server's log
    lines, by request id."""
    records: dict[str, dict[str, Any]] = {}
    for line in log.read_text(errors="replace").splitlines():
        _, found, payload = line.partition(f" {REQUEST_LOGGER.name} ")
        if found and payload.startswith("{"):
            try:
                record = json.loads(payload)
            except json.JSONDecodeError:
                continue
            records[str(record.get("request_id"))] = record
    return records


def same_clock() -> bool:
    """Whether the client's ``perf_counter`` and the engine's ``monotonic`` are one clock
    (true on Linux: both CLOCK_MONOTONIC), so their instants can be subtracted."""
    a, b = time.get_clock_info("perf_counter"), time.get_clock_info("monotonic")
    return a.implementation == b.implementation
