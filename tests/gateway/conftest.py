"""Real engine replicas (``kvserve serve`` processes with gRPC) and an in-process gateway.

Replicas are separate processes on loopback ports, as in production; the gateway runs in
this process (uvicorn in a thread) so tests can inject its rate-limit clock and read its
state. Everything is stopped at the end of the module or test that started it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from kvserve.gateway.app import create_gateway_app
from kvserve.gateway.config import GatewayConfig, KeysFile, hash_key
from tests.server.conftest import free_port, metric, wait_until

MODEL = "tiny"
KEY_A = "sk-test-tenant-a"  # every model, generous limits
KEY_B = "sk-test-tenant-b"  # only "other-model"
KEY_LIMITED = "sk-test-limited"  # 2 requests per minute


@dataclass
class Replica:
    proc: subprocess.Popen[str]
    http: str
    grpc_port: int

    @property
    def grpc_url(self) -> str:
        return f"grpc://127.0.0.1:{self.grpc_port}"

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.http, name, **labels)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def start_replicas(model_dir: Path, n: int, *extra: str) -> list[Replica]:
    """``n`` ``kvserve serve`` processes (HTTP + gRPC), started together, once ready."""
    reps = []
    for _ in range(n):
        http_port, grpc_port = free_port(), free_port()
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "kvserve", "serve", "--model", str(model_dir),
                "--served-model-name", MODEL, "--port", str(http_port),
                "--grpc-port", str(grpc_port), "--dtype", "float32", "--block-size", "4",
                "--log-level", "warning", *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        reps.append(Replica(proc, f"http://127.0.0.1:{http_port}", grpc_port))

    def ready(rep: Replica) -> bool:
        if rep.proc.poll() is not None:
            raise RuntimeError(f"replica exited with {rep.proc.returncode}")
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


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Gateway:
    url: str
    app: Any
    server: uvicorn.Server
    clock: FakeClock
    thread: threading.Thread
    headers: dict[str, str] = field(default_factory=lambda: {"authorization": f"Bearer {KEY_A}"})

    @property
    def state(self) -> Any:
        return self.app.state.gateway

    def client(self, key: str | None = KEY_A) -> httpx.Client:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.url, name, **labels)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def keys_file(models_b: tuple[str, ...] = ("other-model",)) -> KeysFile:
    return KeysFile.model_validate(
        {
            "keys": [
                {"tenant": "team-a", "sha256": hash_key(KEY_A), "models": ["*"]},
                {"tenant": "team-b", "sha256": hash_key(KEY_B), "models": list(models_b)},
                {
                    "tenant": "limited",
                    "sha256": hash_key(KEY_LIMITED),
                    "models": ["*"],
                    "limits": {"requests_per_minute": 2, "tokens_per_minute": 400},
                },
            ]
        }
    )


def start_gateway(replicas: list[Replica], **overrides: Any) -> Gateway:
    model = {
        "replicas": [r.grpc_url for r in replicas],
        "max_tokens_ceiling": 256,
        "max_in_flight_per_replica": overrides.pop("max_in_flight", 8),
    }
    config = GatewayConfig.model_validate(
        {
            "models": {MODEL: model},
            "keys_file": "unused.yaml",
            "max_body_bytes": 16 * 1024,
            "load_poll_seconds": 0.2,
            **overrides,
        },
        strict=False,
    )
    return serve_gateway(config, keys_file())


def serve_gateway(config: GatewayConfig, keys: KeysFile, watcher: Any = None) -> Gateway:
    """The gateway app for ``config`` under uvicorn in a thread, once it is ready."""
    clock = FakeClock()
    app = create_gateway_app(config, keys, clock=clock, watcher=watcher)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=30)
    gw = Gateway(f"http://127.0.0.1:{port}", app, server, clock, thread)
    wait_until(lambda: httpx.get(f"{gw.url}/ready").status_code == 200, timeout=30)
    return gw


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir: Callable[[str], Path]) -> Path:
    return checkpoint_dir("llama")


@pytest.fixture(scope="module")
def replicas(model_dir: Path) -> Iterator[list[Replica]]:
    reps = start_replicas(model_dir, 2)
    yield reps
    for rep in reps:
        rep.stop()


@pytest.fixture
def gateway(replicas: list[Replica]) -> Iterator[Gateway]:
    gw = start_gateway(replicas)
    yield gw
    gw.stop()


def stream_text(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    """POST a streaming request; the text and the parsed chunks."""
    import json

    chunks: list[Any] = []
    text = ""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            chunks.append(chunk)
            for choice in chunk.get("choices", []):
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, chunks
