"""The OpenAI response shapes, built from plain values.

One definition for the engine server (which knows the tokenizer) and the gateway (which
gets token texts over gRPC): both pass ``token_text``, a function from token id to text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.openai.errors import OpenAIError
from kvserve.outputs import RequestOutput, TokenLogprob

TokenText = Callable[[int], str]
SSE_DONE = "data: [DONE]\n\n"
# Where an answer's reasoning goes: ``reasoning_content`` (DeepSeek's name, which clients
# written for it and for earlier vLLM read) and ``reasoning`` (vLLM's since 2026, as
# OpenAI advised for chain of thought in Chat Completions). Both, with the same text.
REASONING_FIELDS = ("reasoning_content", "reasoning")


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload``."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def tokenizer_text(tokenizer: Any) -> TokenText:
    """``token_text`` from a Hugging Face tokenizer (the id itself without one)."""
    if tokenizer is None:
        return str
    return lambda token_id: str(tokenizer.decode([token_id]))


def decoded(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The text of a token-id prompt, special tokens included (what ``echo`` returns)."""
    return "" if tokenizer is None else str(tokenizer.decode(list(token_ids)))


# ---- logprobs ----------------------------------------------------------------------------
def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """``choices[].logprobs`` of /v1/chat/completions."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **item(e.token_id, e.logprob),
                "top_logprobs": [item(t, lp) for t, lp in e.top.items()],
            }
            for e in entries
        ]
    }


def completion_logprobs(
    entries: Sequence[TokenLogprob],
    token_text: TokenText,
    text_offset: int = 0,
    unscored: Sequence[int] = (),
) -> dict[str, Any]:
    """``choices[].logprobs`` of /v1/completions (legacy format). ``unscored``: tokens
    before ``entries`` that have no logprob (an echoed prompt's first): null in
    ``token_logprobs`` and ``top_logprobs``, as OpenAI's API gives them. Each
    ``top_logprobs`` entry holds the chosen token too, as OpenAI's and vLLM's do ("the
    API will always return the logprob of the sampled token"): up to logprobs + 1."""
    tokens = [token_text(t) for t in unscored] + [token_text(e.token_id) for e in entries]
    offsets = []
    for tok in tokens:
        offsets.append(text_offset)
        text_offset += len(tok)
    nulls: list[Any] = [None] * len(unscored)
    return {
        "tokens": tokens,
        "token_logprobs": nulls + [e.logprob for e in entries],
        "top_logprobs": nulls + [_with_chosen(e, token_text) for e in entries],
        "text_offset": offsets,
    }


def _with_chosen(entry: TokenLogprob, token_text: TokenText) -> dict[str, float]:
    top = {token_text(t): lp for t, lp in entry.top.items()}
    top.setdefault(token_text(entry.token_id), entry.logprob)
    return top


@dataclass(frozen=True)
class Echo:
    """What ``echo`` puts before a completion's answer: the prompt's text and, when the
    request asks for logprobs, its tokens: ``unscored`` (the first, which nothing
    predicts) and then ``entries``, each scored from the tokens before it."""

    text: str
    unscored: Sequence[int] = ()
    entries: Sequence[TokenLogprob] = ()

    @classmethod
    def of(cls, text: str, out: RequestOutput) -> Echo:
        """The echo of ``out``'s prompt, whose text is ``text``: with its scores when the
        request asked for prompt logprobs."""
        scores = out.prompt_logprobs
        if scores is None:
            return cls(text)
        return cls(text, out.prompt_token_ids[:1], [e for e in scores[1:] if e is not None])

    def logprobs(
        self,
        entries: Sequence[TokenLogprob],
        token_text: TokenText,
        streamed: StreamedCompletionLogprobs | None = None,
    ) -> dict[str, Any]:
        """The legacy logprobs of the prompt followed by ``entries`` (the answer's, or
        its first chunk's)."""
        joined = [*self.entries, *entries]
        if streamed is not None:
            return streamed.chunk(joined, token_text, self.unscored)
        return completion_logprobs(joined, token_text, 0, self.unscored)


class StreamedCompletionLogprobs:
    """The logprobs of a streamed /v1/completions answer, chunk by chunk: each chunk's
    ``text_offset`` goes on from the chunk before, as in the whole answer (and vLLM)."""

    def __init__(self) -> None:
        self.offset = 0

    def chunk(
        self, entries: Sequence[TokenLogprob], token_text: TokenText, unscored: Sequence[int] = ()
    ) -> dict[str, Any]:
        logprobs = completion_logprobs(entries, token_text, self.offset, unscored)
        self.offset += sum(map(len, logprobs["tokens"]))
        return logprobs


# ---- bodies --------------------------------------------------------------------------------
def model_entry(model: str, listed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``GET /v1/models/{model}``: its entry among ``listed`` (``/v1/models``'s data), or
    OpenAI's 404 ``model_not_found``."""
    for entry in listed:
        if entry["id"] == model:
            return entry
    raise OpenAIError(
        404, f"the model {model!r} does not exist here", param="model", code="model_not_found"
    )


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """OpenAI's usage; ``completion_tokens_details.reasoning_tokens`` only where a
    reasoning parser counted them (as vLLM gives it)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def response_ids(request_id: str, model: str, chat: bool, created: int) -> dict[str, Any]:
    """The fields every body of one response shares: id, created, model."""
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        "created": created,
        "model": model,
    }


def completion_chunk(
    ids: dict[str, Any],
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    index: int = 0,
) -> dict[str, Any]:
    """A piece of choice ``index`` of a completion (every choice's piece is its own chunk)."""
    return {
        **ids,
        "object": "text_completion",
        "choices": [completion_choice(index, text, logprobs, finish_reason)],
    }


def completion_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def with_stop_reason(choice: dict[str, Any], stop_reason: str | int | None) -> dict[str, Any]:
    """``choice`` with vLLM's ``stop_reason``: the stop string or stop token id that ended
    it, null when something else did (EOS, the length, a grammar's end). Whole answers
    carry it on every choice, streams on the chunk with the finish reason (``finished``)."""
    choice["stop_reason"] = stop_reason
    return choice


def finished(event: dict[str, Any], stop_reason: str | int | None) -> dict[str, Any]:
    """A stream ``event`` with ``stop_reason`` on its choice that finishes, if it has one."""
    for choice in event["choices"]:
        if choice.get("finish_reason") is not None:
            with_stop_reason(choice, stop_reason)
    return event


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the answer's call ``index``: its first (the header) carries ``id`` and
    ``name``; each piece appends ``arguments`` (the call's JSON text, in order)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


def joined_calls(deltas: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """The calls ``deltas`` make, whole (``message.tool_calls``), in index order."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.id is not None:
            function = {"name": d.name or "", "arguments": d.arguments}
            calls[d.index] = {"id": d.id, "type": "function", "function": function}
        else:
            calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def chat_chunk(
    ids: dict[str, Any],
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    first: bool,
    reasoning: str = "",
    index: int = 0,
) -> dict[str, Any]:
    """A chat delta of choice ``index`` with text (``content``) and/or reasoning
    (``REASONING_FIELDS``); a delta with reasoning only has no ``content``."""
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    if text or not reasoning:
        delta["content"] = text
    if reasoning:
        delta |= dict.fromkeys(REASONING_FIELDS, reasoning)
    return _chat_chunk(ids, delta, logprobs, finish_reason, index)


def chat_openings(ids: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The first chunk of each of ``n`` chat choices, in index order (role, empty
    content), as vLLM sends them before any text: the openai SDK's stream helper adds a
    choice when its index first appears and fails on an index that comes out of order,
    which choices held back (a partial character, a possible stop string) would do."""
    return [chat_chunk(ids, "", None, None, True, index=i) for i in range(n)]


def tool_call_chunks(
    ids: dict[str, Any], calls: Sequence[ToolCallDelta], first: bool, index: int = 0
) -> list[dict[str, Any]]:
    """OpenAI's streaming shape of call deltas: a header opens a call (index, id, type,
    name, empty arguments); its arguments, and those of later pieces, are appended."""
    chunks = []
    for call in calls:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        first = False
        if call.id is not None:
            opening: dict[str, Any] = {
                "index": call.index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            chunks.append(_chat_chunk(ids, {**delta, "tool_calls": [opening]}, None, None, index))
            delta = {}
            if not call.arguments:
                continue
        appended = {"index": call.index, "function": {"arguments": call.arguments}}
        chunks.append(_chat_chunk(ids, {**delta, "tool_calls": [appended]}, None, None, index))
    return chunks


def _chat_chunk(
    ids: dict[str, Any],
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    index: int,
) -> dict[str, Any]:
    return {
        **ids,
        "object": "chat.completion.chunk",
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }


def usage_chunk(ids: dict[str, Any], chat: bool, usage_: dict[str, Any]) -> dict[str, Any]:
    """The ``stream_options.include_usage`` chunk: no choices, the usage."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {**ids, "object": obj, "choices": [], "usage": usage_}


def completion_response(
    ids: dict[str, Any], choices: list[dict[str, Any]], usage_: dict[str, Any]
) -> dict[str, Any]:
    """The whole answer: ``choices`` from ``completion_choice``, one per sample."""
    return {**ids, "object": "text_completion", "choices": choices, "usage": usage_}


def chat_choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    reasoning: str | None = None,
    tool_calls: Sequence[ToolCallDelta] = (),
) -> dict[str, Any]:
    """One whole answer of a chat (``tool_calls``: its call deltas, joined). With tool
    calls and no text, ``content`` is null (OpenAI's); the reasoning (``REASONING_FIELDS``)
    is there when a reasoning parser is on."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        message |= dict.fromkeys(REASONING_FIELDS, reasoning)
    if tool_calls:
        message["content"] = text or None
        message["tool_calls"] = joined_calls(tool_calls)
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_response(
    ids: dict[str, Any], choices: list[dict[str, Any]], usage_: dict[str, Any]
) -> dict[str, Any]:
    """The whole chat answer: ``choices`` from ``chat_choice``, one per sample."""
    return {**ids, "object": "chat.completion", "choices": choices, "usage": usage_}
