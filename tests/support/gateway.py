"""An in-process gateway in front of real replicas (uvicorn in a thread), so tests can
inject its rate-limit clock and cache-salt secret and read its state."""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from kvserve.gateway.app import create_gateway_app
from kvserve.gateway.config import GatewayConfig
from kvserve.gateway.keys import KeysFile, hash_key
from kvserve.gateway.tenancy import CacheSalts
from kvserve.sse_events import DONE, event_data, parse_event
from tests.support.net import free_port
from tests.support.prometheus import metric
from tests.support.replicas import REPLICA_MODEL, Replica
from tests.support.waiting import wait_until

KEY_A = "sk-test-tenant-a"  # every model, generous limits
KEY_B = "sk-test-tenant-b"  # only "other-model"
KEY_LIMITED = "sk-test-limited"  # 2 requests per minute
TEST_SALT_SECRET = b"kvserve-tests-cache-salt-secret"


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


def keys_file(
    models_b: tuple[str, ...] = ("other-model",), extra: tuple[dict[str, Any], ...] = ()
) -> KeysFile:
    """Tenants team-a (KEY_A), team-b (KEY_B) and limited (KEY_LIMITED), and ``extra``."""
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
                *extra,
            ]
        }
    )


def start_gateway(
    replicas: list[Replica], keys: KeysFile | None = None, **overrides: Any
) -> Gateway:
    model = {
        "replicas": [r.grpc_url for r in replicas],
        "max_tokens_ceiling": overrides.pop("max_tokens_ceiling", 256),
        "max_in_flight_per_replica": overrides.pop("max_in_flight", 8),
    }
    config = GatewayConfig.model_validate(
        {
            "models": {REPLICA_MODEL: model},
            "keys_file": "unused.yaml",
            "max_body_bytes": 16 * 1024,
            "load_poll_seconds": 0.2,
            **overrides,
        },
        strict=False,
    )
    return serve_gateway(config, keys or keys_file())


def serve_gateway(
    config: GatewayConfig, keys: KeysFile, watcher: Any = None, ready_path: str = "/ready"
) -> Gateway:
    """The gateway app for ``config`` under uvicorn in a thread, once ``ready_path``
    answers 200 (``/health`` for a gateway with no replica yet: ``/ready`` waits for one)."""
    clock = FakeClock()
    app = create_gateway_app(
        config, keys, clock=clock, watcher=watcher, salts=CacheSalts(TEST_SALT_SECRET)
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=30)
    gw = Gateway(f"http://127.0.0.1:{port}", app, server, clock, thread)
    wait_until(lambda: httpx.get(f"{gw.url}{ready_path}").status_code == 200, timeout=30)
    return gw


def stream_text(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    """POST a streaming request; the text and the parsed chunks."""
    chunks: list[Any] = []
    text = ""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            data = event_data(line)
            if data is None or data == DONE:
                continue
            chunks.append(json.loads(data))
            text += parse_event(data).text
    return text, chunks


def gateway_command(directory: Path, listen: str, replica_url: str) -> list[str]:
    """The argv of ``kvserve gateway`` with a config written in ``directory``: ``listen``
    (a flow mapping, e.g. ``{port: 8080}``), one model served by ``replica_url``, and a
    keys file holding ``KEY_A``."""
    (directory / "keys.yaml").write_text(
        f'keys:\n  - tenant: a\n    sha256: "{hash_key(KEY_A)}"\n    models: ["*"]\n'
    )
    config = directory / "gateway.yaml"
    config.write_text(
        f"listen: {listen}\n"
        f"models:\n  {REPLICA_MODEL}:\n    replicas: ['{replica_url}']\n"
        "keys_file: keys.yaml\n"
    )
    return [sys.executable, "-m", "kvserve", "gateway", "--config", str(config)]
