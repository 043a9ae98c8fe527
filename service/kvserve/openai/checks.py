"""The request checks both front ends (engine server and gateway) apply, written once.

Each takes a parsed body and returns what the engine needs, or raises ``OpenAIError``
400 naming the parameter. What only one side can check stays there: the engine server
knows the tokenizer and the context length, the gateway knows keys, quotas and ceilings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

from kvserve.errors import InvalidRequestError
from kvserve.openai.errors import OpenAIError
from kvserve.openai.protocol import ChatCompletionRequest, CommonRequest, CompletionRequest
from kvserve.sampling_params import INT32_MAX, StopLimits

# OpenAI's default for /v1/completions; a chat without a limit gets what the context leaves.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# A completion's choices (prompts × n): each is a request in the engine.
MAX_CHOICES = 1024
MAX_COMPLETION_TOKENS = "max_completion_tokens"
_MAX_TOKENS = re.compile(r"\bmax_tokens\b")  # the word alone, not max_tokens_cap


@dataclass(frozen=True)
class TokenLimit:
    """The client's output-token limit and the parameter that set it (for errors).

    ``value`` is None when a chat set none: the engine then allows what the context
    leaves after the prompt.
    """

    value: int | None
    param: str


def check_options(body: CommonRequest) -> None:
    """Options that do not go with each other, refused as OpenAI's API and vLLM do:
    ``stream_options`` without ``stream``, a chat's ``top_logprobs`` without ``logprobs:
    true`` (which would otherwise return no logprobs at all)."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(
            400, "stream_options is only allowed with stream: true", param="stream_options"
        )
    if (
        isinstance(body, ChatCompletionRequest)
        and body.top_logprobs is not None
        and not body.logprobs
    ):
        raise OpenAIError(
            400, "top_logprobs is only allowed with logprobs: true", param="top_logprobs"
        )


def completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion: one text or token-id list, or OpenAI's batch of
    either. Each gets ``n`` choices: prompt i's are choices i·n to i·n + n − 1. At most
    MAX_CHOICES choices in all."""
    prompt = body.prompt
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    # (the schema allows a list of texts or of token-id lists, never a mix)
    prompts = cast(list[str | list[int]], list(prompt) if batch else [prompt])
    if len(prompts) * body.n > MAX_CHOICES:
        raise OpenAIError(
            400,
            f"{len(prompts)} prompts × n={body.n} is {len(prompts) * body.n} choices; "
            f"at most {MAX_CHOICES} in one request",
            param="prompt",
        )
    return prompts


def token_limit(body: CompletionRequest | ChatCompletionRequest) -> TokenLimit:
    """The output-token limit: ``max_completion_tokens`` over ``max_tokens`` for a chat,
    ``max_tokens`` (default 16) for a completion; a limit below 1 is a 400."""
    if isinstance(body, ChatCompletionRequest):
        if body.max_completion_tokens is not None:
            limit = TokenLimit(body.max_completion_tokens, MAX_COMPLETION_TOKENS)
        else:
            limit = TokenLimit(body.max_tokens, "max_tokens")
    else:
        value = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        limit = TokenLimit(value, "max_tokens")
    # OpenAI's legacy API takes 0 with echo: the prompt scored, nothing generated.
    scoring = isinstance(body, CompletionRequest) and body.echo and limit.value == 0
    if limit.value is not None and limit.value < 1 and not scoring:
        raise OpenAIError(
            400,
            f"{limit.param} must be ≥ 1 (0 only with echo), got {limit.value}",
            param=limit.param,
        )
    if limit.value is not None and limit.value > INT32_MAX:
        raise OpenAIError(
            400, f"{limit.param} must be at most {INT32_MAX}, got {limit.value}", param=limit.param
        )
    return limit


def in_client_terms(
    error: OpenAIError, body: CompletionRequest | ChatCompletionRequest
) -> OpenAIError:
    """An engine's refusal (a 400 from ``InvalidRequestError``, or a replica's
    ``INVALID_ARGUMENT``) naming the field the client sent. The engine calls the output
    limit ``max_tokens`` whichever field set it, so a chat's ``max_completion_tokens``
    would be refused as a ``max_tokens`` the client never sent; and a chat's prompt is
    its ``messages`` (as OpenAI names it in a context-length error)."""
    if not isinstance(body, ChatCompletionRequest):
        return error
    message, param = error.message, error.param
    if param == "prompt":
        param = "messages"
    if body.max_completion_tokens is not None and _MAX_TOKENS.search(message):
        message = _MAX_TOKENS.sub(MAX_COMPLETION_TOKENS, message)
    if body.max_completion_tokens is not None and param == "max_tokens":
        param = MAX_COMPLETION_TOKENS
    if (message, param) == (error.message, error.param):
        return error
    return OpenAIError(error.status, message, param=param, code=error.code, headers=error.headers)


def logprobs_count(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many top alternatives to return per token, or None for no logprobs."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def check_stop(body: CommonRequest, limits: StopLimits) -> None:
    """The stop strings are within the server's limits (400 naming ``stop``)."""
    try:
        limits.check(body.stop_list)
    except InvalidRequestError as exc:
        raise OpenAIError.invalid_request(exc) from None
