"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` (OpenAI semantics)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from kvserve.engine.request import Request as EngineRequest
from kvserve.errors import InvalidRequestError
from kvserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvserve.server.errors import OpenAIError
from kvserve.server.logprobs import chat_logprobs, completion_logprobs
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, _Common
from kvserve.server.state import ServerState, State

router = APIRouter()


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": state.served_model_name,
                "object": "model",
                "created": 0,
                "owned_by": "kvserve",
                "max_model_len": state.max_model_len,
            }
        ],
    }


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, state: State
) -> JSONResponse | StreamingResponse:
    arrival = time.monotonic()
    _check_common(body, state)
    prompt: str | list[int]
    if isinstance(body.prompt, list) and any(isinstance(p, str) for p in body.prompt):
        if len(body.prompt) != 1 or not isinstance(body.prompt[0], str):
            raise OpenAIError(400, "only one prompt per request is supported", param="prompt")
        prompt = body.prompt[0]
    else:
        prompt = body.prompt  # type: ignore[assignment]
    if body.max_tokens is not None and body.max_tokens < 1:
        raise OpenAIError(400, f"max_tokens must be ≥ 1, got {body.max_tokens}", param="max_tokens")
    req = _make_request(
        state,
        request,
        body,
        prompt,
        body.max_tokens or 16,
        body.logprobs,
        arrival,
    )
    rid = req.request_id
    ids = {"id": f"cmpl-{rid}", "created": int(time.time()), "model": state.served_model_name}

    if body.stream:

        def chunk(out: RequestOutput) -> dict[str, Any]:
            c = out.outputs[0]
            return {
                **ids,
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": c.delta_text,
                        "logprobs": _delta_logprobs(completion_logprobs, state, c),
                        "finish_reason": c.finish_reason,
                    }
                ],
            }

        return _sse(state.engine, req, chunk, ids, "text_completion", body.include_usage)

    out = await _run_to_end(request, state.engine, req)
    c = out.outputs[0]
    return JSONResponse(
        {
            **ids,
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": c.text,
                    "logprobs": (
                        completion_logprobs(state.tokenizer, c.logprobs) if c.logprobs else None
                    ),
                    "finish_reason": c.finish_reason,
                }
            ],
            "usage": _usage(out),
        }
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: State
) -> JSONResponse | StreamingResponse:
    arrival = time.monotonic()
    _check_common(body, state)
    tok = state.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise OpenAIError(
            400,
            f"model {state.served_model_name!r} has no chat template; use /v1/completions",
            param="messages",
        )
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids: list[int] = tok.encode(text, add_special_tokens=False)
    limit = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if limit is not None and limit < 1:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise OpenAIError(400, f"{param} must be ≥ 1, got {limit}", param=param)
    if limit is None:  # as much as the context allows
        limit = max(state.max_model_len - len(prompt_ids), 1)
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    req = _make_request(state, request, body, prompt_ids, limit, top_n, arrival)
    rid = req.request_id
    ids = {"id": f"chatcmpl-{rid}", "created": int(time.time()), "model": state.served_model_name}

    if body.stream:
        first = True

        def chunk(out: RequestOutput) -> dict[str, Any]:
            nonlocal first
            c = out.outputs[0]
            delta: dict[str, Any] = {"content": c.delta_text}
            if first:
                delta["role"] = "assistant"
                first = False
            return {
                **ids,
                "object": "chat.completion.chunk",
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": _delta_logprobs(chat_logprobs, state, c),
                        "finish_reason": c.finish_reason,
                    }
                ],
            }

        return _sse(state.engine, req, chunk, ids, "chat.completion.chunk", body.include_usage)

    out = await _run_to_end(request, state.engine, req)
    c = out.outputs[0]
    return JSONResponse(
        {
            **ids,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(state.tokenizer, c.logprobs) if c.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
            ],
            "usage": _usage(out),
        }
    )


# ---- shared pieces -------------------------------------------------------------------
def _check_common(body: _Common, state: ServerState) -> None:
    if not state.admitting:
        raise OpenAIError(503, "the server is shutting down; retry on another replica")
    if body.model != state.served_model_name:
        raise OpenAIError(
            404,
            f"model {body.model!r} is not served here (available: {state.served_model_name!r})",
            param="model",
            code="model_not_found",
        )
    if body.n != 1:
        raise OpenAIError(400, f"n={body.n} is not supported (only n=1)", param="n")


def _make_request(
    state: ServerState,
    request: Request,
    body: _Common,
    prompt: str | list[int],
    max_tokens: int,
    logprobs: int | None,
    arrival: float,
) -> EngineRequest:
    rid: str = request.state.request_id
    try:
        params = body.sampling_params(max_tokens, logprobs)
        req = state.engine.make_request(prompt, params, rid, arrival_time=arrival)
        operation = "chat" if isinstance(body, ChatCompletionRequest) else "text_completion"
        state.telemetry.begin(rid, operation, params, request.headers, arrival)
        return req
    except EngineDeadError as exc:
        raise OpenAIError(503, str(exc)) from exc
    except InvalidRequestError as exc:
        raise OpenAIError(400, str(exc), param=exc.param) from exc
    except ValueError as exc:  # a duplicate request id
        raise OpenAIError(400, str(exc), param="x-request-id") from exc


def _delta_logprobs(
    fmt: Callable[[Any, list[TokenLogprob]], dict[str, Any]],
    state: ServerState,
    c: CompletionOutput,
) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    return fmt(state.tokenizer, c.logprobs[len(c.logprobs) - len(c.delta_token_ids) :])


def _usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def _sse(
    engine: AsyncEngine,
    req: EngineRequest,
    chunk: Callable[[RequestOutput], dict[str, Any]],
    ids: dict[str, Any],
    obj: str,
    include_usage: bool,
) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        last: RequestOutput | None = None
        try:
            async for out in engine.stream(req):
                last = out
                c = out.outputs[0]
                if c.delta_text or c.finish_reason is not None or c.logprobs is not None:
                    yield f"data: {json.dumps(chunk(out), ensure_ascii=False)}\n\n"
        except (RequestFailedError, EngineDeadError) as exc:
            err = {
                "error": {"message": str(exc), "type": "server_error", "param": None, "code": None}
            }
            yield f"data: {json.dumps(err)}\n\n"
        if include_usage and last is not None:
            usage = {**ids, "object": obj, "choices": [], "usage": _usage(last)}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"

    # Starlette cancels this generator when the client disconnects; the engine stream's
    # cleanup then aborts the request before the next step.
    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )


async def _run_to_end(request: Request, engine: AsyncEngine, req: EngineRequest) -> RequestOutput:
    """Run a non-streaming request, aborting it if the client disconnects meanwhile."""

    async def last_output() -> RequestOutput:
        last = None
        async for out in engine.stream(req):
            last = out
        assert last is not None
        return last

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(last_output())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
    if not work.done() or work.cancelled():
        await asyncio.gather(work, return_exceptions=True)
        raise OpenAIError(499, "client disconnected")
    try:
        return work.result()
    except EngineDeadError as exc:
        raise OpenAIError(503, str(exc)) from exc
    except RequestFailedError as exc:
        raise OpenAIError(500, f"request {req.request_id} failed: {exc}") from exc
