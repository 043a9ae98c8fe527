"""The gateway's HTTP app: the OpenAI API in front of the engine replicas (gRPC).

This module builds the app and runs its lifespan. The routes are
``kvserve.gateway.routes``; the order of a completion's checks ``completion``; the
upstream call and its retries ``call``; the response translation ``relay``; the
background tasks ``background``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from kvserve.gateway import background
from kvserve.gateway.admission import AdmissionQueue
from kvserve.gateway.auth import KeyStore
from kvserve.gateway.config import GatewayConfig
from kvserve.gateway.keys import KeysFile
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.ratelimit import RateLimiter
from kvserve.gateway.replicas import Fleet
from kvserve.gateway.routes import gateway_router, scrape_metrics
from kvserve.gateway.routing import make_router
from kvserve.gateway.state import GatewayState
from kvserve.gateway.tenancy import CacheSalts
from kvserve.gateway.watch import ConfigWatcher
from kvserve.openai.errors import install_error_handlers
from kvserve.openai.middleware import RequestContextMiddleware
from kvserve.openai.refusal_pacing import RefusalPacer
from kvserve.telemetry.metrics_listener import MetricsListener
from kvserve.telemetry.tracing import tracer_provider_from_env


def create_gateway_app(
    config: GatewayConfig,
    keys: KeysFile,
    *,
    watcher: ConfigWatcher | None = None,
    clock: Callable[[], float] = time.monotonic,
    metrics: GatewayMetrics | None = None,
    tracer_provider: TracerProvider | None = None,
    salts: CacheSalts | None = None,
    refusal_pacer: RefusalPacer | None = None,
) -> FastAPI:
    """The gateway app; replicas are connected and polled while it runs (lifespan).

    ``clock`` drives the rate limiters (inject a fake one in tests). ``salts`` defaults to
    the secret in ``$KVSERVE_CACHE_SALT_SECRET`` (``kvserve.gateway.tenancy``). With
    ``listen.metrics_port``, ``/metrics`` is served there while the app runs, and not on
    the API's port.
    """
    metrics = metrics or GatewayMetrics()
    fleet = Fleet()
    queue = AdmissionQueue(
        config.admission.queue_size,
        config.admission.queue_timeout_seconds,
        on_wait=metrics.queue_wait.observe,
        slots=fleet.slots,
    )
    fleet.on_change = queue.notify
    provider = tracer_provider or tracer_provider_from_env("kvserve-gateway")
    keystore = KeyStore(keys)
    limiter = RateLimiter(clock)
    limiter.update(keystore.tenants)
    state = GatewayState(
        config=config,
        keys=keystore,
        limiter=limiter,
        fleet=fleet,
        queue=queue,
        router=make_router(config.routing.policy, config.routing.load_factor),
        metrics=metrics,
        tracer=trace.get_tracer("kvserve.gateway", tracer_provider=provider),
        salts=salts or CacheSalts.from_env(),
        watcher=watcher,
    )

    listen = config.listen
    listener = None
    if listen.metrics_port is not None:
        listener = MetricsListener(
            lambda: scrape_metrics(state), listen.host, listen.metrics_port, listen.http_limits
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if listener is not None:
            await listener.start()
        for name, model in config.models.items():
            if model.replicas:
                addresses = [background.replica_address(url) for url in model.replicas]
                fleet.set_replicas(name, addresses, model.max_in_flight_per_replica)
        discovery = background.start_discovery(state) if config.discovery.kubernetes else None
        state.tasks.append(asyncio.create_task(background.poll_loads(state)))
        if watcher is not None:
            state.tasks.append(asyncio.create_task(background.watch_keys(state, watcher)))
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            if discovery is not None:
                await asyncio.to_thread(discovery.stop)
            for task in state.tasks:
                task.cancel()
            await asyncio.gather(*state.tasks, return_exceptions=True)
            await fleet.close()
            if listener is not None:
                await listener.stop()

    # The gateway is the public entry: its API description is served only when the
    # config asks for it (docs/security.md).
    docs = config.serve_api_docs
    app = FastAPI(
        title="kvserve gateway",
        lifespan=lifespan,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url=None,
    )
    app.state.gateway = state
    app.include_router(gateway_router(state))
    install_error_handlers(app)
    validation_handler = app.exception_handlers[RequestValidationError]

    async def invalid(request: Request, exc: Exception) -> Response:
        metrics.rejections.labels("invalid").inc()
        return await validation_handler(request, exc)  # type: ignore[no-any-return,misc]

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_middleware(
        RequestContextMiddleware,  # type: ignore[arg-type]
        max_body_bytes=config.max_body_bytes,
        body_timeout=config.listen.body_timeout_seconds,
        pacer=refusal_pacer,
        on_error=lambda status: metrics.rejections.labels(
            "payload_too_large" if status == 413 else "invalid"
        ).inc(),
    )
    return app
