"""The gateway's HTTP routes: health, readiness, metrics, the model list, and the OpenAI
API, whose routes authenticate the key (before the body is read, so an anonymous client
gets nothing parsed and no detailed errors), parse the body, authenticate the key again
(a key revoked or changed by a reload while the body arrived is refused, or serves under
its new terms: a slow body must not extend an old key's life) and hand it to
``kvserve.gateway.completion``, which says the order of the rest of a request's path.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.gateway import adapters
from kvserve.gateway.auth import AuthError, Tenant
from kvserve.gateway.completion import refused, serve
from kvserve.gateway.state import GatewayState
from kvserve.openai import checks
from kvserve.openai import format as fmt
from kvserve.openai.body import body_schema, parse_body
from kvserve.openai.errors import OpenAIError, error_response
from kvserve.openai.messages import template_messages
from kvserve.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.openai.structured import requested_constraint
from kvserve.openai.tools import chat_tools


def scrape_metrics(state: GatewayState) -> tuple[bytes, str]:
    """The exposition text, gauges refreshed from the fleet first, and its content type."""
    state.update_gauges()
    return state.metrics.render(), "text/plain; version=0.0.4"


def gateway_router(state: GatewayState) -> APIRouter:
    """The routes; ``/metrics`` only while it has no listener of its own
    (``listen.metrics_port``)."""
    router = APIRouter()

    @router.head("/health", include_in_schema=False)  # load balancers probe with HEAD
    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.head("/ready", response_model=None, include_in_schema=False)
    @router.get("/ready", response_model=None)
    async def ready(request: Request) -> JSONResponse:
        routable = {
            model: sum(v.routable for v in state.fleet.views(model))
            for model in state.fleet.models()
        }
        if not state.ready or not any(routable.values()):
            return error_response(503, "no healthy replica to route to", request=request)
        return JSONResponse({"status": "ready", "replicas": routable})

    if state.config.listen.metrics_port is None:

        @router.get("/metrics")
        async def metrics() -> Response:
            body, content_type = scrape_metrics(state)
            return Response(body, media_type=content_type)

    @router.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": listed(_authenticate(state, request))}

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
        """One entry of ``/v1/models`` for this key (OpenAI's retrieve); a model the key
        may not use is as unknown as one that does not exist (404)."""
        return fmt.model_entry(model, listed(_authenticate(state, request)))

    def listed(tenant: Tenant) -> list[dict[str, Any]]:
        """What ``/v1/models`` shows ``tenant``: each model and adapter it may use."""
        data: list[dict[str, Any]] = []
        for model in state.model_names():
            entry = {
                "id": model,
                "object": "model",
                "created": state.created,
                "owned_by": "kvserve",
            }
            if tenant.allows(model):
                data.append({**entry, "root": model, "parent": None})
            # An adapter shows to keys that may use it, even if not its base model.
            data.extend(
                {**entry, "id": name, "root": model, "parent": model}
                for name in adapters.known(state, model)
                if tenant.allows(name)
            )
        return data

    @router.post(
        "/v1/completions", response_model=None, openapi_extra=body_schema(CompletionRequest)
    )
    async def completions(request: Request) -> Response:
        _authenticate(state, request)
        try:
            body = await parse_body(request, CompletionRequest)
            prompts = checks.completion_prompts(body)
            constraint = requested_constraint(body)
        except OpenAIError:
            state.metrics.rejections.labels("invalid").inc()
            raise
        tenant = _authenticate(state, request)  # again: see the module docstring
        return await serve(state, request, tenant, body, prompts, constraint=constraint)

    @router.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra=body_schema(ChatCompletionRequest),
    )
    async def chat(request: Request) -> Response:
        _authenticate(state, request)
        try:  # the model's output is read by the replica; here only the input is checked
            body = await parse_body(request, ChatCompletionRequest)
            messages = template_messages(body.messages)
            tools = chat_tools(body)
            constraint = requested_constraint(body)
        except OpenAIError:
            state.metrics.rejections.labels("invalid").inc()
            raise
        tenant = _authenticate(state, request)  # again: see the module docstring
        return await serve(
            state, request, tenant, body, [messages], tools=tools, constraint=constraint
        )

    return router


def _authenticate(state: GatewayState, request: Request) -> Tenant:
    try:
        return state.keys.authenticate(request.headers.get("authorization"))
    except AuthError as exc:
        raise refused(state, exc) from None
