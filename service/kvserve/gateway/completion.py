"""One completion (or chat completion) through the gateway, after its route has
authenticated the key and parsed the body.

A completion goes through, in order (each step's refusal has its status and metric
reason): request id and body size (middleware; 400 / 413 ``payload_too_large``) → API
key (401 ``unauthenticated``; before the body is read, so an anonymous client gets
nothing parsed and no detailed errors) → JSON schema (400 ``invalid``) → a known model or
LoRA adapter (404) → key allowed for that name (403 ``forbidden``) → the shared request
checks and the ``max_tokens`` ceiling (400 ``invalid``) → per-tenant rate limits (429
``rate_limited_*``/``concurrency``) → a replica slot, routed and possibly queued (503
``queue_full``/``queue_timeout``; ``no_healthy_replica`` at once when no replica could
take it) → the request on the replica's shared ``GenerateMany``
call, retried on another replica while no output has been received (``call``) → the
answer, streamed or whole (``relay``).

Response headers go out only once the replica has sent its first message, so a replica
failing before any output is retried invisibly, and an engine refusal (INVALID_ARGUMENT)
becomes a 400 naming the engine's parameter. A client that goes away at any point
(queued, waiting for the first token, mid-stream) has its upstream request cancelled,
which aborts the request in the engine and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from kvserve.conversation import text_chars
from kvserve.errors import InvalidRequestError
from kvserve.gateway import adapters, auth, relay
from kvserve.gateway.auth import AuthError, Tenant
from kvserve.gateway.call import UpstreamCall
from kvserve.gateway.ratelimit import LimitExceeded, RateLimited
from kvserve.gateway.routing import prefix_key
from kvserve.gateway.state import GatewayState
from kvserve.openai import checks
from kvserve.openai import format as fmt
from kvserve.openai.disconnect import until_disconnected
from kvserve.openai.errors import OpenAIError
from kvserve.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.openai.sse import EventStreamResponse
from kvserve.openai.structured import Constraint
from kvserve.openai.tools import ChatTools
from kvserve.rpc.codec import Prompt, encode_request
from kvserve.sampling_params import INT32_MAX, SamplingParams

CHARS_PER_TOKEN = 4  # admission estimate of prompt tokens; settled to the real count later


def refused(state: GatewayState, exc: AuthError) -> OpenAIError:
    state.metrics.rejections.labels(exc.reason).inc()
    return OpenAIError(exc.status, exc.message, code=exc.code, headers=exc.headers)


def _not_found(state: GatewayState, tenant: Tenant, name: str) -> OpenAIError:
    """404 ``model_not_found``, listing only the names this key may use: an adapter's name
    (often a customer's) is not shown to other tenants."""
    names = [m for m in state.model_names() if tenant.allows(m)]
    names += [a for m in state.model_names() for a in adapters.known(state, m) if tenant.allows(a)]
    shown = name[: auth.MAX_MODEL_IN_MESSAGE]
    return OpenAIError(
        404,
        f"model {shown!r} is not served here (available: {', '.join(names)})",
        param="model",
        code="model_not_found",
    )


def _checked_limit(
    state: GatewayState, body: CompletionRequest | ChatCompletionRequest, ceiling: int | None
) -> checks.TokenLimit:
    """The shared checks, then the model's ``max_tokens`` ceiling (400 ``invalid``)."""
    try:
        checks.check_options(body)
        checks.check_stop(body, state.config.stop_limits)
        limit = checks.token_limit(body)
        if limit.value is not None and ceiling is not None and limit.value > ceiling:
            raise OpenAIError(
                400,
                f"{limit.param}={limit.value} is over this model's limit of {ceiling}",
                param=limit.param,
            )
    except OpenAIError:
        state.metrics.rejections.labels("invalid").inc()
        raise
    return limit


async def serve(
    state: GatewayState,
    request: Request,
    tenant: Tenant,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: Sequence[Prompt],
    *,
    tools: ChatTools | None = None,
    constraint: Constraint | None = None,
) -> Response:
    """Serve ``body`` for ``tenant`` (its key authenticated, the body parsed):
    ``prompts`` are a completion's (one, or a batch) or a chat's conversation."""
    s = time.monotonic()
    rid: str = request.state.request_id
    chat = isinstance(body, ChatCompletionRequest)
    resolved = adapters.resolve(state, body.model)
    if resolved is None:
        raise _not_found(state, tenant, body.model)
    model, adapter = resolved  # the model's replicas serve the request, under the adapter
    try:
        state.keys.authorize(tenant, body.model)  # a key names each adapter it may use
    except AuthError as exc:
        raise refused(state, exc) from None
    if adapter is not None and not adapters.serving(state, model):
        # Else it would wait in the queue for a replica that can never take it.
        raise OpenAIError(
            503,
            f"no replica of {model!r} serves LoRA adapters now (--enable-lora)",
            headers={"retry-after": "1"},
        )
    ceiling = state.config.model_settings(model).max_tokens_ceiling
    limit = _checked_limit(state, body, ceiling)
    try:
        # Without a limit max_tokens is not sent: the replica resolves it (what the context
        # leaves, at most the ceiling) and checks what depends on it, such as min_tokens.
        max_tokens = INT32_MAX if limit.value is None else limit.value
        params = body.sampling_params(max_tokens, checks.logprobs_count(body))
        ending = (
            body.chat_ending() if isinstance(body, ChatCompletionRequest) else "generation_prompt"
        )
    except InvalidRequestError as exc:
        state.metrics.rejections.labels("invalid").inc()
        raise checks.in_client_terms(OpenAIError.invalid_request(exc), body) from None
    cache_salt = state.salts.salt(tenant, body.cache_salt)
    upstreams = []  # prompt i's sample j at i·n + j (its choice's index)
    for prompt in prompts:
        upstream = encode_request(
            prompt,
            params,
            request_id=rid,
            max_tokens_set=limit.value is not None,
            max_tokens_cap=ceiling,  # a chat without max_tokens gets no more than the ceiling
            cache_salt=cache_salt,
            tools=tools,
            constraint=constraint,
            template_kwargs=(
                body.template_kwargs() if isinstance(body, ChatCompletionRequest) else None
            ),
            chat_ending=ending,
            echo=isinstance(body, CompletionRequest) and body.echo,
        )
        if adapter is not None:
            upstream.lora_adapter = adapter
        upstreams += _samples(upstream, params)

    # Token reservation: the prompt estimate + the most the request may generate (every
    # sample); settled to the real usage at the end, an overrun charged as debt
    # (kvserve.gateway.ratelimit).
    prompt_estimate = sum(_prompt_estimate(prompt, tools) for prompt in prompts)
    most = _most_output_tokens(state, model, limit, ceiling, prompt_estimate) * len(upstreams)
    reserve = prompt_estimate + most
    try:
        admission = state.limiter.admit(tenant, reserve, len(upstreams))
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
            **({"kvserve.lora_adapter": adapter} if adapter is not None else {}),
        },
    )
    metadata: dict[str, str] = {"x-request-id": rid}
    propagate.inject(metadata, context=trace.set_span_in_context(span))
    call = UpstreamCall(
        state, model, tenant, admission, span, s, prompt_estimate, adapter, samples=body.n
    )
    try:
        # Routing groups by the tenant's salt and the adapter as well: the engine shares
        # KV blocks across neither.
        routed: dict[str, Any] = {"messages" if chat else "prompt": prompts[0]}
        routed |= {"cache_salt": cache_salt, "lora_adapter": adapter}
        key = prefix_key(routed, state.config.routing.prefix_chars)
        firsts = await until_disconnected(request, call.start(key, upstreams, metadata))
    except BaseException as exc:
        call.close(exc)
        if isinstance(exc, OpenAIError) and exc.status == 400:  # the replica refused it
            raise checks.in_client_terms(exc, body) from None
        raise
    if firsts is None:  # the client left while queued or before the first token
        call.close(None, disconnected=True)
        raise OpenAIError(499, "client disconnected")
    if isinstance(body, CompletionRequest) and body.echo and not all(map(_echoed, firsts)):
        # A replica from before echo ignores the field: its answer would lack the prompt.
        error = OpenAIError(
            502, "the replica does not support echo (it predates this gateway); upgrade it"
        )
        call.close(error)
        raise error
    ids = fmt.response_ids(rid, body.model, chat, int(time.time()))
    logprobs = checks.logprobs_count(body) is not None
    if body.stream:
        return EventStreamResponse(
            relay.sse(call, firsts, ids, chat, body.include_usage, logprobs, request_id=rid),
            headers=admission.headers,
            on_close=lambda: call.close(None, disconnected=not call.done and call.status == 200),
            write_timeout=state.config.write_stall_timeout_seconds,
        )
    try:
        result = await until_disconnected(request, relay.collect(call, firsts, ids, chat, logprobs))
    except asyncio.CancelledError:  # the handler was cancelled: the client is gone
        call.close(None, disconnected=True)
        raise
    except BaseException as exc:  # failed upstream: counted with the client's status
        call.close(exc)
        raise
    call.close(None, disconnected=result is None)
    if result is None:
        raise OpenAIError(499, "client disconnected")
    return JSONResponse(result, headers=admission.headers)


def _echoed(first: Any) -> bool:
    """Whether a sample's first message carries the echo its request asked for (or ends
    it before any output)."""
    if first.WhichOneof("kind") == "delta":
        return bool(first.delta.HasField("echo"))
    return bool(first.final.finish_reason == "abort")


def _samples(upstream: Any, params: SamplingParams) -> list[Any]:
    """The upstream request of each of ``params``'s samples (``n``): ``upstream``, or
    copies of it whose seeds are those of ``SamplingParams.samples``."""
    samples = params.samples()
    if len(samples) == 1:
        return [upstream]
    copies = []
    for sample in samples:
        copy = type(upstream)()
        copy.CopyFrom(upstream)
        if sample.seed is not None:
            copy.seed = sample.seed
        copies.append(copy)
    return copies


def _most_output_tokens(
    state: GatewayState,
    model: str,
    limit: checks.TokenLimit,
    ceiling: int | None,
    prompt_estimate: int,
) -> int:
    """The most output tokens a request may get: its limit, or for a chat without one,
    what the replicas' context leaves after the prompt, capped by the model's ceiling."""
    if limit.value is not None:
        return limit.value
    context = state.fleet.max_model_len(model)
    bounds = [b for b in (ceiling, context and max(context - prompt_estimate, 1)) if b]
    # Before any replica reported its context (the first load poll), the completion
    # default; the overrun is then charged as debt.
    return min(bounds) if bounds else checks.DEFAULT_COMPLETION_MAX_TOKENS


def _prompt_estimate(prompt: Prompt, tools: ChatTools | None = None) -> int:
    """Prompt tokens, estimated: a chat's text, tool calls and tool schemas by characters
    (plus the template's few tokens per message)."""
    if isinstance(prompt, str):
        return math.ceil(len(prompt) / CHARS_PER_TOKEN)
    if prompt and isinstance(prompt[0], dict):
        template_tools = tools.template_tools() if tools is not None else None
        chars = text_chars(prompt, template_tools) + 8 * len(prompt)  # type: ignore[arg-type]
        return math.ceil(chars / CHARS_PER_TOKEN)
    return len(prompt)
