"""A real engine server in this process: uvicorn on a free loopback port, in a thread."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from opentelemetry.trace import TracerProvider

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.openai.chat_output import ChatParsing
from kvserve.server.app import create_app
from kvserve.telemetry.prometheus import EngineMetrics
from tests.support.net import free_port

SERVED_MODEL = "tiny-llama"


@dataclass
class RunningServer:
    url: str
    port: int
    engine: LLMEngine
    server: uvicorn.Server
    grpc_port: int | None = None

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)  # type: ignore[arg-type]


def start_server(
    model_dir: Path,
    tracer_provider: TracerProvider | None = None,
    grpc: bool = False,
    max_body_bytes: int = 64 * 1024,
    write_stall_timeout: float = 30.0,
    chat_parsing: ChatParsing | None = None,
    **engine_kw: object,
) -> RunningServer:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", **engine_kw)  # type: ignore[arg-type]
    engine = LLMEngine(cfg)
    app = create_app(
        engine,
        SERVED_MODEL,
        max_body_bytes=max_body_bytes,
        write_stall_timeout=write_stall_timeout,
        metrics=EngineMetrics(SERVED_MODEL),
        tracer_provider=tracer_provider,
        grpc_address=("127.0.0.1", 0) if grpc else None,
        chat_parsing=chat_parsing,
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
