"""A real engine server (uvicorn on a free loopback port) for the HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from opentelemetry.trace import TracerProvider
from prometheus_client.parser import text_string_to_metric_families

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import create_app
from kvserve.telemetry.prometheus import EngineMetrics

MODEL = "tiny-llama"


@dataclass
class RunningServer:
    url: str
    port: int
    engine: LLMEngine
    server: uvicorn.Server
    grpc_port: int | None = None

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    model_dir: Path,
    tracer_provider: TracerProvider | None = None,
    grpc: bool = False,
    **engine_kw: object,
) -> RunningServer:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", **engine_kw)  # type: ignore[arg-type]
    engine = LLMEngine(cfg)
    app = create_app(
        engine,
        MODEL,
        max_body_bytes=64 * 1024,
        metrics=EngineMetrics(MODEL),
        tracer_provider=tracer_provider,
        grpc_address=("127.0.0.1", 0) if grpc else None,
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    grpc_port = getattr(app.state, "grpc_port", None)
    return RunningServer(f"http://127.0.0.1:{port}", port, engine, server, grpc_port)


def stop_server(srv: RunningServer) -> None:
    srv.server.should_exit = True


@pytest.fixture(scope="module")
def server(checkpoint_dir) -> Iterator[RunningServer]:  # type: ignore[no-untyped-def]
    srv = start_server(checkpoint_dir("llama"), block_size=4)
    yield srv
    stop_server(srv)


def wait_until(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Poll with a deadline (never a bare sleep as synchronisation)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.01)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` at ``url``/metrics whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
