"""A small app behind the HTTP protocol and middleware both kvserve servers run (head
limits, body limit and timeout, refusal pacing), under uvicorn in a thread on loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI, Request

from kvserve.openai.errors import install_error_handlers
from kvserve.openai.http_limits import HttpLimits, protocol_with
from kvserve.openai.middleware import RequestContextMiddleware
from kvserve.openai.refusal_pacing import RefusalPacer
from tests.support.net import free_port
from tests.support.waiting import wait_until


@contextmanager
def guarded_server(
    limits: HttpLimits, max_body_bytes: int, pacer: RefusalPacer | None = None
) -> Iterator[int]:
    """The port of a server whose ``POST /echo`` answers ``{"bytes": <body length>}``."""
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    install_error_handlers(app)
    app.add_middleware(
        RequestContextMiddleware,  # type: ignore[arg-type]
        max_body_bytes=max_body_bytes,
        body_timeout=limits.body_timeout,
        pacer=pacer,
    )
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", http=protocol_with(limits, pacer)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=30)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)
