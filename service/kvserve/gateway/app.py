"""The gateway's HTTP app: the OpenAI API in front of the engine replicas (gRPC).

A request goes through, in order (each step's refusal has its status and metric reason):
request id and body size (middleware; 400 / 413 ``payload_too_large``) → JSON schema
(400 ``invalid``) → API key (401 ``unauthenticated``) → model known (404) → key allowed
for it (403 ``forbidden``) → ``max_tokens`` ceiling (400 ``invalid``) → per-tenant rate
limits (429 ``rate_limited_*``/``concurrency``) → a replica slot, routed and possibly
queued (503 ``queue_full``/``queue_timeout``) → the request on the replica's shared
``GenerateMany`` call, retried on another replica while no output has been received → the
answer, streamed or whole.

Response headers go out only once the replica has sent its first message, so a replica
failing before any output is retried invisibly, and an engine refusal (INVALID_ARGUMENT)
becomes a 400 with the engine's message. A client that goes away at any point (queued,
waiting for the first token, mid-stream) has its upstream request cancelled, which aborts
the request in the engine and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, TracerProvider

from kvserve.errors import InvalidRequestError
from kvserve.gateway.admission import AdmissionQueue, AdmissionRejected, Slot
from kvserve.gateway.auth import AuthError, KeyStore, Tenant
from kvserve.gateway.config import ConfigWatcher, GatewayConfig, KeysFile, parse_replica_url
from kvserve.gateway.discovery import KubernetesDiscovery, Snapshot
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.ratelimit import Admission, LimitExceeded, RateLimited, RateLimiter
from kvserve.gateway.replicas import Fleet, Replica
from kvserve.gateway.routing import Router, make_router, prefix_key
from kvserve.gateway.upstream import delta_logprobs, generate_request
from kvserve.server import openai_format as fmt
from kvserve.server.disconnect import until_disconnected
from kvserve.server.errors import OpenAIError, error_body, install_error_handlers
from kvserve.server.json_body import body_schema, parse_body
from kvserve.server.middleware import RequestContextMiddleware
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, _Common
from kvserve.server.sse import SSE_DONE, EventStreamResponse, TextEvents, encode_event
from kvserve.telemetry.tracing import tracer_provider_from_env

log = logging.getLogger("kvserve.gateway")
T = TypeVar("T")

CHARS_PER_TOKEN = 4  # admission estimate of prompt tokens; settled to the real count later
DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
# Engine refusals that mean "this request is bad", not "this replica is bad": never retried.
_CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


@dataclass
class GatewayState:
    config: GatewayConfig
    keys: KeyStore
    limiter: RateLimiter
    fleet: Fleet
    queue: AdmissionQueue
    router: Router
    metrics: GatewayMetrics
    tracer: trace.Tracer
    watcher: ConfigWatcher | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    ready: bool = False

    def model_names(self) -> list[str]:
        """Models in the config, plus those discovery found replicas for."""
        return sorted(set(self.config.models) | set(self.fleet.models()))

    def serves(self, model: str) -> bool:
        """``model in model_names()``, without building the list (every request asks)."""
        return model in self.config.models or model in self.fleet.replicas

    def update_gauges(self) -> None:
        m = self.metrics
        m.queue_length.set(self.queue.queue_length)
        for model in self.fleet.models():
            m.add_model(model)
            counts = {"healthy": 0, "unhealthy": 0, "draining": 0}
            for view in self.fleet.views(model):
                m.add_replica(model, self.config.routing.policy, view.address)
                state = "draining" if view.draining else "healthy" if view.healthy else "unhealthy"
                counts[state] += 1
                m.in_flight.labels(model, view.address).set(view.in_flight)
            for state, n in counts.items():
                m.replicas.labels(model, state).set(n)


def create_gateway_app(
    config: GatewayConfig,
    keys: KeysFile,
    *,
    watcher: ConfigWatcher | None = None,
    clock: Callable[[], float] = time.monotonic,
    metrics: GatewayMetrics | None = None,
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    """The gateway app; replicas are connected and polled while it runs (lifespan).

    ``clock`` drives the rate limiters (inject a fake one in tests).
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
        watcher=watcher,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for name, model in config.models.items():
            if model.replicas:
                addresses = [_address(url) for url in model.replicas]
                fleet.set_replicas(name, addresses, model.max_in_flight_per_replica)
        discovery = _start_discovery(state) if config.discovery.kubernetes else None
        state.tasks.append(asyncio.create_task(_poll_loads(state)))
        if watcher is not None:
            state.tasks.append(asyncio.create_task(_watch_keys(state, watcher)))
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

    app = FastAPI(title="kvserve gateway", lifespan=lifespan)
    app.state.gateway = state
    app.include_router(_router(state))
    install_error_handlers(app)
    validation_handler = app.exception_handlers[RequestValidationError]

    async def invalid(request: Request, exc: Exception) -> Response:
        metrics.rejections.labels("invalid").inc()
        return await validation_handler(request, exc)  # type: ignore[no-any-return,misc]

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_middleware(
        RequestContextMiddleware,  # type: ignore[arg-type]
        max_body_bytes=config.max_body_bytes,
        on_error=lambda status: metrics.rejections.labels(
            "payload_too_large" if status == 413 else "invalid"
        ).inc(),
    )
    return app


def _start_discovery(state: GatewayState) -> KubernetesDiscovery:
    """Watch the cluster; each snapshot becomes the models' replica sets (static ones kept)."""
    cfg = state.config.discovery.kubernetes
    assert cfg is not None
    loop = asyncio.get_running_loop()
    discovered: set[str] = set()

    def apply(snapshot: Snapshot) -> None:
        for model in sorted(discovered | set(snapshot)):
            settings = state.config.model_settings(model)
            static = [_address(url) for url in settings.replicas]
            state.fleet.set_replicas(
                model, [*static, *snapshot.get(model, [])], settings.max_in_flight_per_replica
            )
        discovered.update(snapshot)
        state.update_gauges()

    discovery = KubernetesDiscovery(
        namespaces=cfg.namespaces,
        label_selector=cfg.label_selector,
        port_name=cfg.port_name,
        kubeconfig=cfg.kubeconfig,
        on_change=lambda snapshot: loop.call_soon_threadsafe(apply, snapshot),
    )
    discovery.start()
    return discovery


def _address(url: str) -> str:
    host, port = parse_replica_url(url)
    return f"{host}:{port}"


async def _poll_loads(state: GatewayState) -> None:
    while True:
        try:
            await state.fleet.poll_once(timeout=max(state.config.load_poll_seconds, 0.5))
            state.update_gauges()
        except Exception:  # a poll round must never stop polling
            log.exception("replica load poll failed")
        await asyncio.sleep(state.config.load_poll_seconds)


async def _watch_keys(state: GatewayState, watcher: ConfigWatcher) -> None:
    while True:
        await asyncio.sleep(state.config.reload_poll_seconds)
        try:
            found = watcher.poll()
        except Exception:
            log.exception("keys file reload failed; keeping the previous keys")
            continue
        if found is None:
            continue
        for error in found.errors:
            log.error("not reloaded, the previous version stays in force: %s", error)
        if found.restart_required:
            log.warning(
                "config changed in fields that need a restart: %s",
                ", ".join(found.restart_required),
            )
        if found.keys is not None:
            state.keys.replace(found.keys)
            state.limiter.update(state.keys.tenants)
            log.info("keys reloaded: %d tenants", len(state.keys.tenants))


# ---- the API ---------------------------------------------------------------------------
def _router(state: GatewayState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/ready", response_model=None)
    async def ready() -> JSONResponse:
        routable = {
            model: sum(v.healthy and not v.draining for v in state.fleet.views(model))
            for model in state.fleet.models()
        }
        if not state.ready or not any(routable.values()):
            return JSONResponse(error_body(503, "no healthy replica to route to"), status_code=503)
        return JSONResponse({"status": "ready", "replicas": routable})

    @router.get("/metrics")
    async def metrics() -> Response:
        state.update_gauges()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @router.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        tenant = _authenticate(state, request)
        names = [m for m in state.model_names() if tenant.allows(m)]
        return {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "kvserve"} for m in names
            ],
        }

    @router.post(
        "/v1/completions", response_model=None, openapi_extra=body_schema(CompletionRequest)
    )
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        prompt: str | list[int]
        if isinstance(body.prompt, list) and any(isinstance(p, str) for p in body.prompt):
            if len(body.prompt) != 1 or not isinstance(body.prompt[0], str):
                raise _invalid(state, "only one prompt per request is supported", "prompt")
            prompt = body.prompt[0]
        else:
            prompt = body.prompt  # type: ignore[assignment]
        limit = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        return await _serve(state, request, body, prompt, limit, "max_tokens", body.logprobs)

    @router.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra=body_schema(ChatCompletionRequest),
    )
    async def chat(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        limit: int | None = body.max_tokens
        param = "max_tokens"
        if body.max_completion_tokens is not None:
            limit, param = body.max_completion_tokens, "max_completion_tokens"
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        return await _serve(state, request, body, messages, limit, param, top_n)

    return router


def _invalid(state: GatewayState, message: str, param: str | None) -> OpenAIError:
    state.metrics.rejections.labels("invalid").inc()
    return OpenAIError(400, message, param=param)


def _refused(state: GatewayState, exc: AuthError) -> OpenAIError:
    state.metrics.rejections.labels(exc.reason).inc()
    return OpenAIError(exc.status, exc.message, code=exc.code, headers=exc.headers)


def _authenticate(state: GatewayState, request: Request) -> Tenant:
    try:
        return state.keys.authenticate(request.headers.get("authorization"))
    except AuthError as exc:
        raise _refused(state, exc) from None


async def _serve(
    state: GatewayState,
    request: Request,
    body: _Common,
    prompt: str | list[int] | list[dict[str, str]],
    limit: int | None,
    limit_param: str,
    logprobs: int | None,
) -> Response:
    s = time.monotonic()
    rid: str = request.state.request_id
    chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    tenant = _authenticate(state, request)
    if not state.serves(body.model):
        raise OpenAIError(
            404,
            f"model {body.model!r} is not served here (available: "
            f"{', '.join(state.model_names())})",
            param="model",
            code="model_not_found",
        )
    try:
        state.keys.authorize(tenant, body.model)
    except AuthError as exc:
        raise _refused(state, exc) from None
    if body.n != 1:
        raise _invalid(state, f"n={body.n} is not supported (only n=1)", "n")
    if limit is not None and limit < 1:
        raise _invalid(state, f"{limit_param} must be ≥ 1, got {limit}", limit_param)
    ceiling = state.config.model_settings(body.model).max_tokens_ceiling
    if limit is not None and ceiling is not None and limit > ceiling:
        raise _invalid(
            state, f"{limit_param}={limit} is over this model's limit of {ceiling}", limit_param
        )
    try:
        params = body.sampling_params(limit or 1, logprobs)
    except InvalidRequestError as exc:
        raise _invalid(state, str(exc), exc.param) from None
    upstream = generate_request(rid, prompt, params, max_tokens_set=limit is not None)

    # Token reservation: prompt estimate + the most it may generate (settled at the end).
    prompt_estimate = _prompt_estimate(prompt)
    reserve = prompt_estimate + (limit or ceiling or DEFAULT_COMPLETION_MAX_TOKENS)
    try:
        admission = state.limiter.admit(tenant, reserve)
    except RateLimited as exc:
        state.metrics.rejections.labels(exc.reason).inc()
        raise OpenAIError(429, exc.message, code=exc.code, headers=exc.headers) from None
    except LimitExceeded as exc:  # could never fit the tenant's budget: a client error
        state.metrics.rejections.labels(exc.reason).inc()
        raise OpenAIError(400, exc.message, code=exc.code, headers=exc.headers) from None

    operation = "chat" if chat else "text_completion"
    span = state.tracer.start_span(
        f"gateway {operation} {body.model}",
        context=propagate.extract(request.headers),
        kind=SpanKind.SERVER,
        attributes={
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": body.model,
            "kvserve.request_id": rid,
            "kvserve.tenant": tenant.name,
        },
    )
    metadata: dict[str, str] = {"x-request-id": rid}
    propagate.inject(metadata, context=trace.set_span_in_context(span))
    call = _Call(state, body.model, tenant, admission, span, s, prompt_estimate)
    try:
        key = prefix_key(
            {"messages": prompt} if chat else {"prompt": prompt},
            state.config.routing.prefix_chars,
        )
        first = await until_disconnected(request, call.start(key, upstream, metadata))
    except BaseException as exc:
        call.close(exc)
        raise
    if first is None:  # the client left while queued or before the first token
        call.close(None, disconnected=True)
        raise OpenAIError(499, "client disconnected")
    ids = fmt.response_ids(rid, body.model, chat, int(time.time()))
    if body.stream:
        return EventStreamResponse(
            call.sse(first, ids, chat, body.include_usage),
            headers=admission.headers,
            on_close=lambda: call.close(None, disconnected=not call.done and call.status == 200),
        )
    try:
        result = await until_disconnected(request, call.collect(first, ids, chat))
    finally:
        call.close(None, disconnected=not call.done)
    if result is None:
        raise OpenAIError(499, "client disconnected")
    return JSONResponse(result, headers=admission.headers)


def _prompt_estimate(prompt: str | list[int] | list[dict[str, str]]) -> int:
    if isinstance(prompt, str):
        return math.ceil(len(prompt) / CHARS_PER_TOKEN)
    if prompt and isinstance(prompt[0], dict):
        chars = sum(len(m["content"]) + 8 for m in prompt)  # type: ignore[index]
        return math.ceil(chars / CHARS_PER_TOKEN)
    return len(prompt)


class _Call:
    """One request's trip to the replicas: slot, call, retries, output, and cleanup."""

    def __init__(
        self,
        state: GatewayState,
        model: str,
        tenant: Tenant,
        admission: Admission,
        span: trace.Span,
        s: float,
        prompt_estimate: int,
    ) -> None:
        self.state, self.model, self.tenant = state, model, tenant
        self.admission, self.span, self.s = admission, span, s
        self.prompt_estimate = prompt_estimate
        self.output_tokens = 0  # seen so far (charged if the request never finishes)
        self.slot: Slot | None = None
        self.grpc_call: Any = None
        self.replica: Replica | None = None
        self.f: float | None = None  # first chunk with text handed to the client
        self.e: float | None = None  # last one
        self.usage_tokens = 0
        self.status = 200
        self.done = False
        self.closed = False

    # ---- before the first token: route, queue, call, retry --------------------------
    async def start(self, key: str, request: Any, metadata: dict[str, str]) -> Any:
        """The replica's first response message; retries on other replicas until one
        answers (or raises the OpenAIError the client gets)."""
        st = self.state
        cfg = st.config
        exclude: set[str] = set()
        last_error = "no replica answered"
        for attempt in range(cfg.retry.max_attempts):
            if attempt:
                st.metrics.retries.labels(self.model).inc()
            decisions: list[Any] = []
            pick = functools.partial(self._pick, key, exclude, decisions)
            try:
                self.slot = await st.queue.acquire(self.tenant.name, self.tenant.priority, pick)
            except AdmissionRejected as exc:
                reason = "queue_timeout" if exc.reason == "timeout" else "queue_full"
                st.metrics.rejections.labels(reason).inc()
                raise OpenAIError(
                    503, str(exc), code=reason, headers={"retry-after": str(exc.retry_after)}
                ) from None
            decision = decisions[-1]
            st.metrics.routing.labels(self.model, cfg.routing.policy, decision.address).inc()
            if decision.overridden or attempt:
                st.metrics.overrides.labels(self.model).inc()
            self.replica = st.fleet.get(self.model, self.slot.address)
            if self.replica is None:  # removed while we waited
                self._release_slot()
                continue
            self.span.set_attribute("kvserve.replica", self.replica.address)
            self.grpc_call = self.replica.client.generate(
                request, cfg.request_timeout_seconds, metadata
            )
            try:
                first = await self.grpc_call.read()
            except grpc.aio.AioRpcError as exc:
                first = exc
            if not isinstance(first, grpc.aio.AioRpcError) and first is not grpc.aio.EOF:
                st.fleet.mark_ok(self.replica)
                return first
            code = first.code() if isinstance(first, grpc.aio.AioRpcError) else None
            detail = first.details() if isinstance(first, grpc.aio.AioRpcError) else "empty"
            st.metrics.upstream_errors.labels(self.model, code.name if code else "EOF").inc()
            self._release_slot()
            if code in _CLIENT_ERRORS:  # the engine refused the request itself
                st.metrics.rejections.labels("invalid").inc()
                raise OpenAIError(400, f"{detail}", param=_param_of(detail or ""))
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise OpenAIError(504, f"the replica did not answer within the timeout: {detail}")
            st.fleet.mark_failed(self.replica, f"{code.name if code else 'EOF'}: {detail}")
            exclude.add(self.replica.address)
            last_error = f"replica {self.replica.address}: {detail}"
        raise OpenAIError(502, f"no replica could serve the request ({last_error})")

    def _pick(self, key: str, exclude: set[str], decisions: list[Any]) -> str | None:
        """The admission queue's ``pick``: route now, remember the decision."""
        decision = self.state.router.route(key, self.state.fleet.views(self.model), exclude)
        if decision is None:
            return None
        decisions.append(decision)
        return str(decision.address)

    # ---- after it: stream or collect ------------------------------------------------------
    def _count(self, delta: Any) -> None:
        self.output_tokens += len(delta.token_ids)

    def _handed_over(self) -> None:
        """A delta with text reached the client (streaming) or the answer (whole): the
        f and e instants of DESIGN.md §3."""
        self.e = time.monotonic()
        if self.f is None:
            self.f = self.e

    async def sse(
        self, first: Any, ids: dict[str, Any], chat: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """The response's events (the response's ``on_close`` ends the call)."""
        plain = TextEvents(ids, chat)
        opening = True  # a chat's first delta carries the role
        read = self.grpc_call.read
        msg = first
        try:
            # The hot loop of the gateway (one pass per streamed token): one generator,
            # the common case (text, no logprobs, not the first chat delta) first.
            while msg is not grpc.aio.EOF:
                if msg.WhichOneof("kind") != "delta":  # the end: one write with [DONE]
                    final = msg.final
                    chunk = self._chunk(ids, chat, "", None, final.finish_reason, opening)
                    ending = [encode_event(chunk)]
                    if include_usage:
                        ending.append(encode_event(fmt.usage_chunk(ids, chat, self._usage(final))))
                    self._finished(final)
                    yield b"".join([*ending, SSE_DONE])
                    return
                delta = msg.delta
                self._count(delta)
                text = delta.text
                lp = delta_logprobs(delta)
                if lp is None and not opening:
                    if text:
                        yield plain.text(text)
                        self._handed_over()
                elif text or lp is not None:
                    yield encode_event(self._chunk(ids, chat, text, lp, None, opening))
                    opening = False
                    if text:
                        self._handed_over()
                msg = await read()
            yield SSE_DONE  # the stream ended without a final (the replica went away)
        except grpc.aio.AioRpcError as exc:  # the replica failed mid-stream: never retried
            self.status = 502
            self.state.metrics.upstream_errors.labels(self.model, exc.code().name).inc()
            error = encode_event(error_body(502, f"the replica failed: {exc.details()}"))
            yield error + SSE_DONE

    async def collect(self, first: Any, ids: dict[str, Any], chat: bool) -> dict[str, Any]:
        text: list[str] = []
        entries: list[Any] = []
        texts: dict[int, str] = {}
        msg = first
        try:
            while msg is not grpc.aio.EOF:
                if msg.WhichOneof("kind") == "delta":
                    delta = msg.delta
                    self._count(delta)
                    text.append(delta.text)
                    if delta.text:
                        self._handed_over()
                    lp = delta_logprobs(delta)
                    if lp is not None:
                        entries += lp.entries
                        texts.update(lp.texts)
                else:
                    final = msg.final
                    self._finished(final)
                msg = await self.grpc_call.read()
        except grpc.aio.AioRpcError as exc:
            self.status = 502
            self.state.metrics.upstream_errors.labels(self.model, exc.code().name).inc()
            raise OpenAIError(502, f"the replica failed: {exc.details()}") from None
        if not self.done:
            self.status = 502
            raise OpenAIError(502, "the replica's stream ended without a final message")
        token_text = lambda t: texts.get(t, str(t))  # noqa: E731
        logprobs: dict[str, Any] | None = None
        if entries:
            logprobs = (
                fmt.chat_logprobs(entries, token_text)
                if chat
                else fmt.completion_logprobs(entries, token_text)
            )
        usage = self._usage(final)
        build = fmt.chat_response if chat else fmt.completion_response
        return build(ids, "".join(text), logprobs, final.finish_reason, usage)

    def _chunk(
        self, ids: dict[str, Any], chat: bool, text: str, lp: Any, finish: str | None, opening: bool
    ) -> dict[str, Any]:
        if chat:
            logprobs = fmt.chat_logprobs(lp.entries, lp.token_text) if lp else None
            return fmt.chat_chunk(ids, text, logprobs, finish, opening)
        logprobs = fmt.completion_logprobs(lp.entries, lp.token_text) if lp else None
        return fmt.completion_chunk(ids, text, logprobs, finish)

    def _usage(self, final: Any) -> dict[str, Any]:
        u = final.usage
        return fmt.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)

    def _finished(self, final: Any) -> None:
        self.done = True
        self.usage_tokens = final.usage.prompt_tokens + final.usage.completion_tokens
        self.span.set_attribute("gen_ai.response.finish_reasons", [final.finish_reason])
        self.span.set_attribute("gen_ai.usage.input_tokens", final.usage.prompt_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", final.usage.completion_tokens)
        self.span.set_attribute("gen_ai.usage.cache_read.input_tokens", final.usage.cached_tokens)

    # ---- cleanup (exactly once) ----------------------------------------------------------------
    def _release_slot(self) -> None:
        if self.slot is not None:
            self.state.queue.release(self.slot)
            self.slot = None

    def close(self, exc: BaseException | None, disconnected: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if self.grpc_call is not None and not self.done:
            self.grpc_call.cancel()  # aborts the request in the engine
        self._release_slot()
        # Settle the token reservation to what was used: the replica's usage when it
        # finished, else the prompt estimate and the tokens produced before the end.
        used = self.usage_tokens if self.done else self.prompt_estimate + self.output_tokens
        self.admission.finish(used if self.grpc_call is not None else 0)
        m = self.state.metrics
        if disconnected:
            m.disconnects.labels(self.model).inc()
            self.status = 499
        elif isinstance(exc, OpenAIError):
            self.status = exc.status
        elif exc is not None:
            self.status = 500
        m.requests.labels(self.model, str(self.status)).inc()
        if self.status == 200:
            m.observe_timeline(self.model, self.s, self.f, self.e)
        self.span.set_attribute("http.response.status_code", self.status)
        self.span.end()


def _param_of(detail: str) -> str | None:
    """The parameter an engine INVALID_ARGUMENT names ("invalid max_tokens: ...")."""
    if detail.startswith("invalid ") and ":" in detail:
        return detail[len("invalid ") : detail.index(":")]
    return None
