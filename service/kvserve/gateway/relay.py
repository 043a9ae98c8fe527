"""The replica's messages as the client's response: SSE events, or one JSON body.

Both read an ``UpstreamCall`` that has its first message, and report to it what reached
the client (tokens counted, first and last text handed over, the final usage).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvserve.gateway.call import UpstreamCall
from kvserve.openai import format as fmt
from kvserve.openai.chat_output import delta_chunks
from kvserve.openai.errors import OpenAIError, error_body
from kvserve.openai.format import ToolCallDelta
from kvserve.openai.sse import SSE_DONE, TextEvents, encode_event
from kvserve.rpc.codec import DeltaLogprobs, decode_chat_delta, decode_delta_logprobs


async def sse(
    call: UpstreamCall, first: Any, ids: dict[str, Any], chat: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    """The response's events (the response's ``on_close`` closes the call)."""
    plain = TextEvents(ids, chat)
    streamed = fmt.StreamedCompletionLogprobs()  # a completion's text offsets so far
    opening = True  # a chat's first delta carries the role
    read = call.grpc_call.read
    msg = first
    try:
        # The hot loop of the gateway (one pass per streamed token): one generator,
        # the common case (text, no logprobs, not the first chat delta) first.
        while msg is not grpc.aio.EOF:
            if msg.WhichOneof("kind") != "delta":  # the end: one write with [DONE]
                final = msg.final
                chunk = _chunk(ids, chat, "", None, final.finish_reason, opening, streamed)
                ending = [encode_event(chunk)]
                if include_usage:
                    ending.append(encode_event(fmt.usage_chunk(ids, chat, _usage(final))))
                call.finished(final)
                yield b"".join([*ending, SSE_DONE])
                return
            delta = msg.delta
            call.count(delta)
            text = delta.text
            lp = decode_delta_logprobs(delta)
            if delta.reasoning or delta.tool_calls:  # a chat the replica's parsers read
                logprobs = fmt.chat_logprobs(lp.entries, lp.token_text) if lp else None
                events = delta_chunks(ids, decode_chat_delta(delta), logprobs, None, opening)
                if events:
                    yield b"".join(encode_event(e) for e in events)
                    opening = False
                    call.handed_over()
            elif lp is None and not opening:
                if text:
                    yield plain.text(text)
                    call.handed_over()
            elif text or lp is not None:
                yield encode_event(_chunk(ids, chat, text, lp, None, opening, streamed))
                opening = False
                if text:
                    call.handed_over()
            msg = await read()
        yield SSE_DONE  # the stream ended without a final (the replica went away)
    except grpc.aio.AioRpcError as exc:  # the replica failed mid-stream: never retried
        call.failed_upstream(exc)
        error = encode_event(error_body(502, f"the replica failed: {exc.details()}"))
        yield error + SSE_DONE


async def collect(
    call: UpstreamCall, first: Any, ids: dict[str, Any], chat: bool
) -> dict[str, Any]:
    """The whole answer as one response body."""
    text: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[ToolCallDelta] = []
    entries: list[Any] = []
    texts: dict[int, str] = {}
    final: Any = None
    msg = first
    try:
        while msg is not grpc.aio.EOF:
            if msg.WhichOneof("kind") == "delta":
                delta = msg.delta
                call.count(delta)
                text.append(delta.text)
                if delta.reasoning or delta.tool_calls:
                    parsed = decode_chat_delta(delta)
                    reasoning.append(parsed.reasoning)
                    tool_calls += parsed.tool_calls
                if delta.text or delta.reasoning or delta.tool_calls:
                    call.handed_over()
                lp = decode_delta_logprobs(delta)
                if lp is not None:
                    entries += lp.entries
                    texts.update(lp.texts)
            else:
                final = msg.final
                call.finished(final)
            msg = await call.read()
    except grpc.aio.AioRpcError as exc:
        call.failed_upstream(exc)
        raise OpenAIError(502, f"the replica failed: {exc.details()}") from None
    if final is None:
        call.status = 502
        raise OpenAIError(502, "the replica's stream ended without a final message")
    token_text = DeltaLogprobs(entries, texts).token_text
    logprobs: dict[str, Any] | None = None
    if entries:
        logprobs = (
            fmt.chat_logprobs(entries, token_text)
            if chat
            else fmt.completion_logprobs(entries, token_text)
        )
    if not chat:
        return fmt.completion_response(
            ids, "".join(text), logprobs, final.finish_reason, _usage(final)
        )
    return fmt.chat_response(
        ids,
        "".join(text),
        logprobs,
        final.finish_reason,
        _usage(final),
        reasoning="".join(reasoning) or None,
        tool_calls=tool_calls,
    )


def _chunk(
    ids: dict[str, Any],
    chat: bool,
    text: str,
    lp: DeltaLogprobs | None,
    finish: str | None,
    opening: bool,
    streamed: fmt.StreamedCompletionLogprobs,
) -> dict[str, Any]:
    if chat:
        logprobs = fmt.chat_logprobs(lp.entries, lp.token_text) if lp else None
        return fmt.chat_chunk(ids, text, logprobs, finish, opening)
    logprobs = streamed.chunk(lp.entries, lp.token_text) if lp else None
    return fmt.completion_chunk(ids, text, logprobs, finish)


def _usage(final: Any) -> dict[str, Any]:
    u = final.usage
    return fmt.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
