"""Build the engine server's FastAPI app around an ``AsyncEngine``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine, EngineHooks
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.errors import install_error_handlers
from kvserve.server.middleware import RequestContextMiddleware
from kvserve.server.routers import health, openai
from kvserve.server.state import ServerState

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def create_app(
    engine: LLMEngine,
    served_model_name: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics: Any | None = None,
) -> FastAPI:
    """The app owns the engine thread: it starts with the app and stops with it."""
    hooks = EngineHooks()
    if metrics is not None:
        hooks = EngineHooks(
            on_finished=metrics.observe_finished,
            on_failed=lambda req: metrics.observe_error(req.num_prompt_tokens),
            on_stats=metrics.observe_engine,
        )
        metrics.set_cache_info(engine.config.block_size, engine.num_kv_blocks)
    async_engine = AsyncEngine(engine, hooks)
    state = ServerState(async_engine, served_model_name, metrics=metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            state.admitting = False
            await async_engine.stop()

    app = FastAPI(title="kvserve engine server", version="0.1.0", lifespan=lifespan)
    app.state.kvserve = state
    install_error_handlers(app)
    app.include_router(openai.router)
    app.include_router(health.router)
    app.add_middleware(RequestContextMiddleware, max_body_bytes=max_body_bytes)
    return app
