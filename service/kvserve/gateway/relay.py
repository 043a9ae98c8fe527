"""The replica's messages as the client's response: SSE events, or one JSON body.

Both read an ``UpstreamCall`` that has every sample's first message, and report to it
what reached the client (tokens counted, first and last text handed over, each sample's
final usage). A request for ``n`` samples is ``n`` upstream requests, read together: each
one's messages become choice ``index`` of the response.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from kvserve.gateway.call import UpstreamCall
from kvserve.openai import format as fmt
from kvserve.openai.chat_output import delta_chunks
from kvserve.openai.errors import OpenAIError, error_body
from kvserve.openai.format import ToolCallDelta
from kvserve.openai.sse import SSE_DONE, TextEvents, encode_event
from kvserve.rpc.codec import (
    DeltaLogprobs,
    decode_chat_delta,
    decode_delta_logprobs,
    decode_echo,
    decode_stop_reason,
)


async def sse(
    call: UpstreamCall,
    firsts: list[Any],
    ids: dict[str, Any],
    chat: bool,
    include_usage: bool,
    logprobs: bool = False,
    request_id: str | None = None,
) -> AsyncIterator[bytes]:
    """The response's events (the response's ``on_close`` closes the call). ``logprobs``:
    the request asked for them (an echoed prompt's scores are shown only then);
    ``request_id`` goes into a mid-stream error, as into every error body."""
    choices = [_StreamedChoice(ids, chat, i, logprobs) for i in range(len(firsts))]
    if chat and len(choices) > 1:  # all open up front, in index order (fmt.chat_openings)
        yield b"".join(encode_event(c) for c in fmt.chat_openings(ids, len(choices)))
        for choice in choices:
            choice.opening = False
    try:
        if len(firsts) == 1:
            # The hot loop of the gateway (one pass per streamed token): one generator,
            # the common case (text only, not the first chat delta) inline.
            choice, read, msg = choices[0], call.grpc_calls[0].read, firsts[0]
            plain = choice.plain
            while msg is not grpc.aio.EOF:
                if msg.WhichOneof("kind") != "delta":
                    yield _ending(call, choice, msg.final, ids, chat, include_usage)
                    return
                delta = msg.delta
                call.count(delta)
                if choice.opening or delta.logprobs or delta.reasoning or delta.tool_calls:
                    event, text = choice.delta(delta)
                    if event:
                        yield event
                    if text:
                        call.handed_over()
                elif delta.text:
                    yield plain.text(delta.text)
                    call.handed_over()
                msg = await read()
            yield SSE_DONE  # the stream ended without a final (the replica went away)
            return
        async for i, msg in messages(call, firsts):
            if msg is grpc.aio.EOF:  # a stream ended without a final (the replica went away)
                yield SSE_DONE
                return
            if msg.WhichOneof("kind") != "delta":
                yield _ending(call, choices[i], msg.final, ids, chat, include_usage)
                if call.done:
                    return
                continue
            call.count(msg.delta)
            event, text = choices[i].delta(msg.delta)
            if event:
                yield event
            if text:
                call.handed_over()
    except grpc.aio.AioRpcError as exc:  # failed mid-stream: never retried
        e = call.failed_upstream(exc)
        error = encode_event(error_body(e.status, e.message, e.param, e.code, request_id))
        yield error + SSE_DONE


def _ending(
    call: UpstreamCall,
    choice: _StreamedChoice,
    final: Any,
    ids: dict[str, Any],
    chat: bool,
    include_usage: bool,
) -> bytes:
    """A sample's last events: its finish reason, and after the last sample's (the call
    is then done), the usage if asked for and ``[DONE]``, in one write."""
    call.finished(choice.index, final)
    last = choice.chunk("", None, final.finish_reason)
    end = encode_event(fmt.finished(last, decode_stop_reason(final)))
    if not call.done:
        return end
    ending = [end]
    if include_usage:
        ending.append(encode_event(fmt.usage_chunk(ids, chat, fmt.usage(*call.usage()))))
    return b"".join([*ending, SSE_DONE])


async def collect(
    call: UpstreamCall, firsts: list[Any], ids: dict[str, Any], chat: bool, logprobs: bool = False
) -> dict[str, Any]:
    """The whole answer as one response body (``logprobs``: as for ``sse``)."""
    choices = [_WholeChoice(logprobs) for _ in firsts]
    try:
        async for i, msg in messages(call, firsts):
            if msg is grpc.aio.EOF:
                break
            if msg.WhichOneof("kind") == "delta":
                call.count(msg.delta)
                if choices[i].add(msg.delta):
                    call.handed_over()
            else:
                call.finished(i, msg.final)
    except grpc.aio.AioRpcError as exc:
        raise call.failed_upstream(exc) from None
    if not call.done:
        call.status = 502
        raise OpenAIError(502, "the replica's stream ended without a final message")
    bodies = [c.body(i, chat, call.finals[i]) for i, c in enumerate(choices)]
    usage = fmt.usage(*call.usage())
    if chat:
        return fmt.chat_response(ids, bodies, usage)
    return fmt.completion_response(ids, bodies, usage)


async def messages(call: UpstreamCall, firsts: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """Each sample's messages as ``(index, message)``, from its first (in ``firsts``) to
    its final (or ``grpc.aio.EOF``), the samples' interleaved as they arrive; raises the
    ``AioRpcError`` of a sample that fails."""
    if len(firsts) == 1:  # the common case, without a task per message
        msg = firsts[0]
        yield 0, msg
        while _open(msg):
            msg = await call.read(0)
            yield 0, msg
        return
    pending: dict[asyncio.Future[Any], int] = {}
    try:
        for i, msg in enumerate(firsts):
            yield i, msg
            if _open(msg):
                pending[asyncio.ensure_future(call.read(i))] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                i = pending.pop(future)
                msg = future.result()
                yield i, msg
                if _open(msg):
                    pending[asyncio.ensure_future(call.read(i))] = i
    finally:
        for future in pending:
            if future.done() and not future.cancelled():
                future.exception()  # retrieved: the first failure is the one raised
            future.cancel()


def _open(msg: Any) -> bool:
    """Whether the sample goes on after ``msg`` (a delta)."""
    return msg is not grpc.aio.EOF and msg.WhichOneof("kind") == "delta"


class _StreamedChoice:
    """One sample's SSE events: choice ``index`` of the response."""

    def __init__(self, ids: dict[str, Any], chat: bool, index: int, logprobs: bool) -> None:
        self.ids, self.chat, self.index, self.logprobs = ids, chat, index, logprobs
        self.plain = TextEvents(ids, chat, index)
        self.streamed = fmt.StreamedCompletionLogprobs()  # a completion's text offsets so far
        self.opening = True  # a chat's first delta carries the role

    def delta(self, delta: Any) -> tuple[bytes, bool]:
        """A delta's events (maybe none), and whether they hand text to the client. The
        common case (text, no logprobs, not the first chat delta) first."""
        text = delta.text
        lp = decode_delta_logprobs(delta)
        if delta.reasoning or delta.tool_calls:  # a chat the replica's parsers read
            logprobs = fmt.chat_logprobs(lp.entries, lp.token_text) if lp else None
            parsed = decode_chat_delta(delta)
            events = delta_chunks(self.ids, parsed, logprobs, None, self.opening, self.index)
            if not events:
                return b"", False
            self.opening = False
            return b"".join(encode_event(e) for e in events), True
        if lp is None and not self.opening:
            return (self.plain.text(text), True) if text else (b"", False)
        echo = decode_echo(delta) if self.opening else None  # a completion's prompt
        if text or lp is not None or echo is not None:
            event = encode_event(self.chunk(text, lp, None, echo))
            self.opening = False
            return event, bool(text)
        return b"", False

    def chunk(
        self,
        text: str,
        lp: DeltaLogprobs | None,
        finish: str | None,
        echo: tuple[fmt.Echo, DeltaLogprobs] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            logprobs = fmt.chat_logprobs(lp.entries, lp.token_text) if lp else None
            return fmt.chat_chunk(self.ids, text, logprobs, finish, self.opening, index=self.index)
        if echo is not None:  # the first chunk starts with the prompt
            prompt, scores = echo
            text = prompt.text + text
            if self.logprobs:  # (max_tokens 0: the prompt's scores alone, no delta's)
                entries = lp.entries if lp is not None else []
                texts = DeltaLogprobs(entries, scores.texts | (lp.texts if lp else {}))
                logprobs = prompt.logprobs(entries, texts.token_text, self.streamed)
                return fmt.completion_chunk(self.ids, text, logprobs, finish, self.index)
        logprobs = self.streamed.chunk(lp.entries, lp.token_text) if lp else None
        return fmt.completion_chunk(self.ids, text, logprobs, finish, self.index)


class _WholeChoice:
    """One sample's answer, gathered: choice ``index`` of the response body."""

    def __init__(self, logprobs: bool) -> None:
        self.logprobs = logprobs  # asked for (an echoed prompt may be scored regardless)
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[ToolCallDelta] = []
        self.entries: list[Any] = []
        self.texts: dict[int, str] = {}
        self.unscored: Sequence[int] = ()  # an echoed prompt's first token

    def add(self, delta: Any) -> bool:
        """Take a delta; whether it added to the answer."""
        echo = decode_echo(delta)
        if echo is not None:  # the first delta: the answer starts with the prompt
            prompt, scores = echo
            self.text.append(prompt.text)
            self.entries += prompt.entries
            self.texts.update(scores.texts)
            self.unscored = prompt.unscored
        self.text.append(delta.text)
        if delta.reasoning or delta.tool_calls:
            parsed = decode_chat_delta(delta)
            self.reasoning.append(parsed.reasoning)
            self.tool_calls += parsed.tool_calls
        lp = decode_delta_logprobs(delta)
        if lp is not None:
            self.entries += lp.entries
            self.texts.update(lp.texts)
        return bool(delta.text or delta.reasoning or delta.tool_calls)

    def body(self, index: int, chat: bool, final: Any) -> dict[str, Any]:
        token_text = DeltaLogprobs(self.entries, self.texts).token_text
        text = "".join(self.text)
        if not chat:
            logprobs = None
            if self.logprobs and (self.entries or self.unscored):
                logprobs = fmt.completion_logprobs(self.entries, token_text, 0, self.unscored)
            choice = fmt.completion_choice(index, text, logprobs, final.finish_reason)
            return fmt.with_stop_reason(choice, decode_stop_reason(final))
        choice = fmt.chat_choice(
            index,
            text,
            fmt.chat_logprobs(self.entries, token_text) if self.entries else None,
            final.finish_reason,
            reasoning="".join(self.reasoning) or None,
            tool_calls=self.tool_calls,
        )
        return fmt.with_stop_reason(choice, decode_stop_reason(final))
