"""``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's run-time adapter
API; the path rules are in ``kvserve.server.lora``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from kvserve.engine.async_engine import EngineDeadError
from kvserve.openai.body import body_schema, parse_body
from kvserve.openai.errors import OpenAIError
from kvserve.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from kvserve.server.state import server_state

router = APIRouter()


@router.post(
    "/v1/load_lora_adapter",
    response_class=PlainTextResponse,
    openapi_extra=body_schema(LoadLoRAAdapterRequest),
)
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = await parse_body(request, LoadLoRAAdapterRequest)
    state = server_state(request)
    try:
        await state.lora.load(
            state.engine, body.lora_name, body.lora_path, inplace=body.load_inplace
        )
    except EngineDeadError as exc:
        raise OpenAIError(503, str(exc)) from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    response_class=PlainTextResponse,
    openapi_extra=body_schema(UnloadLoRAAdapterRequest),
)
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    body = await parse_body(request, UnloadLoRAAdapterRequest)
    state = server_state(request)
    try:
        await state.lora.unload(state.engine, body.lora_name)
    except EngineDeadError as exc:
        raise OpenAIError(503, str(exc)) from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
