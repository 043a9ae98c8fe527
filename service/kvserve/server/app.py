"""Build the engine server's FastAPI app around an ``AsyncEngine``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from opentelemetry.trace import TracerProvider

from kvserve.engine.async_engine import AsyncEngine, EngineHooks
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.request import Request
from kvserve.openai.chat_output import ChatParsing
from kvserve.openai.errors import install_error_handlers
from kvserve.openai.http_limits import HttpLimits
from kvserve.openai.middleware import DEFAULT_BODY_TIMEOUT, RequestContextMiddleware
from kvserve.openai.refusal_pacing import RefusalPacer
from kvserve.openai.stalls import DEFAULT_WRITE_STALL_SECONDS
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import StopLimits
from kvserve.server.grpc_service import start_grpc_server
from kvserve.server.lora import LoRAAdapters
from kvserve.server.routers import health, lora, openai
from kvserve.server.state import ServerState
from kvserve.telemetry.metrics_listener import MetricsListener
from kvserve.telemetry.prometheus import EngineMetrics
from kvserve.telemetry.tracing import RequestTelemetry, tracer_provider_from_env

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
log = logging.getLogger("kvserve.server")


# A prompt character takes at most this many bytes of JSON (an escaped character outside
# the BMP: a surrogate pair, \uXXXX\uXXXX); the rest of a body needs far less than the slack.
JSON_BYTES_PER_CHAR = 12
BODY_SLACK_BYTES = 64 * 1024


def body_limit(max_body_bytes: int, engine: LLMEngine) -> int:
    """The body limit: ``max_body_bytes``, or less where no prompt that long could fit.

    A body bigger than the longest prompt the engine can take (``max_prompt_chars``) is
    refused from its Content-Length, before it is read and parsed: megabyte bodies sent
    in a loop would otherwise hold the event loop for tens of milliseconds each.
    """
    if engine.max_prompt_chars is None:
        return max_body_bytes
    return min(max_body_bytes, JSON_BYTES_PER_CHAR * engine.max_prompt_chars + BODY_SLACK_BYTES)


def create_app(
    engine: LLMEngine,
    served_model_name: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    stop_limits: StopLimits | None = None,
    write_stall_timeout: float = DEFAULT_WRITE_STALL_SECONDS,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    metrics: EngineMetrics | None = None,
    tracer_provider: TracerProvider | None = None,
    grpc_address: tuple[str, int] | None = None,
    metrics_address: tuple[str, int] | None = None,
    http_limits: HttpLimits | None = None,
    refusal_pacer: RefusalPacer | None = None,
    chat_parsing: ChatParsing | None = None,
    lora_modules: dict[str, str] | None = None,
    lora_dir: str | None = None,
) -> FastAPI:
    """The app owns the engine thread: it starts with the app and stops with it.

    ``tracer_provider`` defaults to OTLP export when OTEL_EXPORTER_OTLP_ENDPOINT is set.
    ``grpc_address`` (host, port) also serves the gRPC API on the same event loop; the
    bound port (useful with port 0) is then ``app.state.grpc_port``.
    ``metrics_address`` (host, port) serves ``/metrics`` on a listener of its own, with
    ``http_limits``, and the API port answers it 404 (docs/security.md); the bound port
    is ``app.state.metrics_port``.
    ``chat_parsing``: how chat answers are read (tool calls, reasoning); by default the
    tool-call format the model's chat template implies, and no reasoning parser.
    ``lora_modules`` (name → adapter folder) are read and checked now (``LoRAError``);
    ``lora_dir`` is the folder ``/v1/load_lora_adapter`` may load from (kvserve.server.lora).
    """
    adapters = LoRAAdapters(served_model_name, engine.lora is not None, lora_dir)
    if engine.lora is not None:  # adapters the engine can no longer read are not served
        adapters.unreadable = engine.lora.is_unreadable
    adapters.add_startup(engine, lora_modules or {})
    metrics = metrics or EngineMetrics(served_model_name)
    metrics.set_cache_info(
        engine.config.block_size, engine.num_kv_blocks, engine.config.kv_cache_dtype
    )
    if engine.kv_events is not None:
        metrics.track_kv_events(engine.kv_events)
    if engine.lora is not None:
        metrics.set_lora_limit(engine.lora.capacity)
    telemetry = RequestTelemetry(served_model_name, tracer_provider or tracer_provider_from_env())

    def finished(out: RequestOutput) -> None:
        metrics.observe_finished(out)
        telemetry.finish(out)

    def failed(req: Request) -> None:
        metrics.observe_error(req.num_prompt_tokens)
        telemetry.fail(req, "engine error")

    hooks = EngineHooks(on_finished=finished, on_failed=failed, on_stats=metrics.observe_engine)
    async_engine = AsyncEngine(engine, hooks)
    stop_limits = stop_limits or StopLimits()
    state = ServerState(
        async_engine,
        served_model_name,
        metrics=metrics,
        telemetry=telemetry,
        lora=adapters,
        stop_limits=stop_limits,
        write_stall_timeout=write_stall_timeout,
        chat_parsing=chat_parsing
        or ChatParsing.for_model(
            None, None, getattr(engine.tokenizer, "chat_template", None), engine.tokenizer
        ),
    )

    listener = None
    if metrics_address is not None:
        listener = MetricsListener(metrics.render, *metrics_address, http_limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if listener is not None:
            app.state.metrics_port = await listener.start()
        async_engine.start()
        grpc_server = None
        if grpc_address is not None:
            grpc_server, app.state.grpc_port = await start_grpc_server(
                async_engine,
                *grpc_address,
                telemetry=telemetry,
                stop_limits=stop_limits,
                chat_parsing=state.chat_parsing,
                lora=adapters,
                admitting=lambda: state.admitting,
                preparing=state.prepared,
            )
            log.info("gRPC API on %s:%d", grpc_address[0], app.state.grpc_port)
        try:
            yield
        finally:
            state.admitting = False
            if grpc_server is not None:
                await grpc_server.stop(grace=1.0)
            await async_engine.stop()
            # The engine thread has stopped: send the queued KV events, stop the
            # tensor-parallel workers.
            engine.close()
            # Last: Prometheus may read the figures until the engine has stopped.
            if listener is not None:
                await listener.stop()

    app = FastAPI(title="kvserve engine server", version="0.1.0", lifespan=lifespan)
    app.state.kvserve = state
    install_error_handlers(app)
    app.include_router(openai.router)
    if engine.lora is not None:
        app.include_router(lora.router)
    app.include_router(health.router)
    if listener is None:
        app.include_router(health.metrics_router)
    app.add_middleware(
        RequestContextMiddleware,
        max_body_bytes=body_limit(max_body_bytes, engine),
        body_timeout=body_timeout,
        pacer=refusal_pacer,
    )
    return app
