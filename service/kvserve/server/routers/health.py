"""Liveness, readiness and Prometheus metrics.

``metrics_router`` is apart: with ``--metrics-port``, ``/metrics`` has a listener of its
own (``kvserve.telemetry.metrics_listener``) and the API port does not route it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from kvserve.openai.errors import error_response
from kvserve.server.state import State

router = APIRouter()


@router.head("/health", include_in_schema=False)  # load balancers probe with HEAD
@router.get("/health")  # (registered first: a 405 names GET)
async def health(state: State, request: Request) -> JSONResponse:
    """The process is alive and its engine thread is running."""
    if state.engine.dead is not None:
        return error_response(503, f"engine stopped: {state.engine.dead}", request=request)
    return JSONResponse({"status": "ok"})


@router.head("/ready", include_in_schema=False)
@router.get("/ready")
async def ready(state: State, request: Request) -> JSONResponse:
    """The model is loaded and new requests are admitted."""
    if state.engine.dead is not None or not state.admitting:
        message = "not admitting requests (draining or engine stopped)"
        return error_response(503, message, request=request)
    return JSONResponse({"status": "ready", "model": state.served_model_name})


metrics_router = APIRouter()


@metrics_router.get("/metrics")
async def metrics(state: State) -> Response:
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)
