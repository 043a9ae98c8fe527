"""Send one streaming OpenAI request and record its client-side timeline.

Works with any ``requests``-style response (Locust's ``HttpSession`` with ``stream=True``,
or plain ``requests``): the caller passes ``post(path, body)``, a context manager yielding
the response. SSE lines are timed as they are read, with ``time.perf_counter``; the send
time is also taken on the wall clock so records from several processes line up.

What counts as what (the record's ``status``):

* ``ok`` -- HTTP 200, no ``error`` event in the stream, a finish reason, and ``[DONE]``.
* ``cancelled`` -- the spec asked to disconnect after N chunks with text, and the client did.
* ``error`` -- everything else, with the reason in ``error``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from kvserve.loadtest.records import RequestRecord, Status, round_us
from kvserve.loadtest.workloads import RequestSpec
from kvserve.sse_events import DONE, event_data, parse_event

Post = Callable[[str, dict[str, Any]], AbstractContextManager[Any]]
Mark = Callable[[Any, Status, str | None], None]
INTERRUPTED = "interrupted: the load test stopped before the response finished"


@dataclass
class _Progress:
    t0: float
    status: Status | None = None
    error: str | None = None
    http_status: int | None = None
    request_id: str | None = None
    chunk_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False
    end: float | None = None

    def fail(self, reason: str) -> None:
        if self.status != "error":  # keep the first reason
            self.status, self.error = "error", reason


def stream_request(
    post: Post,
    spec: RequestSpec,
    model: str,
    *,
    extra_body: dict[str, Any] | None = None,
    user: str | None = None,
    mark: Mark | None = None,
    sink: Callable[[RequestRecord], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    wall: Callable[[], float] = time.time,
) -> RequestRecord:
    """Send ``spec``, read the stream to the end (or cancel), return and ``sink`` the record.

    ``mark(response, status, error)`` runs inside the response's context (Locust marks its
    own request entry there). A ``BaseException`` that is not an ``Exception`` (gevent's
    ``GreenletExit`` when Locust stops a user) still sinks an ``error`` record, then
    propagates.
    """
    send_time = wall()
    p = _Progress(t0=clock())
    try:
        with post(spec.path, spec.body(model, extra_body)) as response:
            try:
                _read(response, spec, p, clock)
            except Exception as exc:
                p.fail(f"{type(exc).__name__}: {exc}")
            if p.end is None:
                p.end = clock()
            _finish(p)
            if mark is not None:
                mark(response, p.status or "error", p.error)
    except Exception as exc:
        p.fail(f"{type(exc).__name__}: {exc}")
    except BaseException:
        p.fail(INTERRUPTED)
        if sink is not None:
            sink(_record(p, spec, send_time, clock, user))
        raise
    rec = _record(p, spec, send_time, clock, user)
    if sink is not None:
        sink(rec)
    return rec


def _read(response: Any, spec: RequestSpec, p: _Progress, clock: Callable[[], float]) -> None:
    p.http_status = int(response.status_code or 0) or None
    headers = getattr(response, "headers", None) or {}
    p.request_id = headers.get("x-request-id")
    if p.http_status is None:
        p.end = clock()
        p.fail(f"no response: {getattr(response, 'error', None) or 'connection failed'}")
        return
    if p.http_status != 200:
        p.end = clock()
        p.fail(f"HTTP {p.http_status}: {_error_message(response)}")
        return
    for raw in response.iter_lines(chunk_size=None):
        now = clock()
        data = event_data(raw)
        if data is None:
            continue  # blank separators, SSE comments (": ping"), other fields
        if data == DONE:
            p.done = True
            p.end = now
            return
        event = parse_event(data)
        if event.error is not None:
            p.fail(f"error event: {event.error}")
            continue
        p.finish_reason = event.finish_reason or p.finish_reason
        if event.usage:
            p.usage = event.usage
        if event.text:
            p.chunk_times.append(now - p.t0)
            if (
                spec.cancel_after_chunks is not None
                and len(p.chunk_times) >= spec.cancel_after_chunks
            ):
                p.end = now
                p.status = p.status or "cancelled"
                response.close()  # disconnect: the server should abort the request
                return
    p.end = clock()


def _finish(p: _Progress) -> None:
    if p.status is not None:
        return
    if not p.done:
        p.fail("the stream ended without [DONE]")
    elif p.finish_reason is None:
        p.fail("no finish_reason in the stream")
    else:
        p.status = "ok"


def _error_message(response: Any) -> str:
    try:
        body = json.loads(response.text)
        return str(body["error"]["message"])
    except Exception:
        text = str(getattr(response, "text", "") or "")
        return text[:200] or "(no body)"


def _record(
    p: _Progress, spec: RequestSpec, send_time: float, clock: Callable[[], float], user: str | None
) -> RequestRecord:
    end = p.end if p.end is not None else clock()
    usage = p.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    times = [round_us(t) for t in p.chunk_times]
    return RequestRecord(
        send_time=round_us(send_time),
        status=p.status or "error",
        end_s=round_us(end - p.t0),
        api=spec.api,
        scenario=spec.scenario,
        first_token_s=times[0] if times else None,
        last_token_s=times[-1] if times else None,
        chunk_times_s=times,
        output_tokens=usage.get("completion_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        finish_reason=p.finish_reason,
        http_status=p.http_status,
        error=p.error,
        max_tokens=spec.max_tokens,
        cancel_after_chunks=spec.cancel_after_chunks,
        request_id=p.request_id,
        user=user,
    )
