"""One JSON log line per finished request, and per request that failed in the engine
(``finish_reason`` ``"error"``: ``failed_record``).

The record holds the request's counts (and ``lora_adapter``, the adapter's name, for a
request that ran under one), its timeline instants (seconds on the engine's
monotonic clock, comparable with each other, not wall-clock time) and the latency
figures of docs/architecture.md §3, computed by ``kvserve.telemetry.definitions``. A figure that is
undefined for the request (no output token yet, O ≤ 1 for TPOT, never scheduled) is
``None``.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from kvserve.outputs import RequestMetrics, RequestOutput
from kvserve.telemetry import definitions as d

if TYPE_CHECKING:
    from kvserve.engine.request import Request

REQUEST_LOGGER = logging.getLogger("kvserve.requests")


def request_record(
    out: RequestOutput, model: str, trace_id: str | None = None
) -> dict[str, object]:
    """A flat, JSON-serialisable summary of one (finished) request."""
    record = _record(
        out.client_id,
        out.request_id,
        len(out.prompt_token_ids),
        out.num_cached_tokens,
        sum(len(c.token_ids) for c in out.outputs),
        out.outputs[0].finish_reason if out.outputs else None,
        out.metrics,
        model,
        trace_id,
    )
    if out.lora_request is not None:  # only under an adapter: base records keep their keys
        record["lora_adapter"] = out.lora_request.lora_name
    return record


def failed_record(req: Request, model: str, trace_id: str | None = None) -> dict[str, object]:
    """The record of a request that failed in the engine: what it had done, finish
    reason ``"error"``."""
    record = _record(
        req.external_id,
        req.request_id,
        req.num_prompt_tokens,
        max(req.num_cached_tokens, 0),  # -1 until admitted
        req.num_output_tokens,
        "error",
        req.metrics,
        model,
        trace_id,
    )
    if req.lora is not None:
        record["lora_adapter"] = req.lora.lora_name
    return record


def _record(
    client_id: str | None,
    engine_id: str,
    prompt_tokens: int,
    cached_tokens: int,
    output_tokens: int,
    finish_reason: str | None,
    m: RequestMetrics,
    model: str,
    trace_id: str | None,
) -> dict[str, object]:
    s = m.arrival_time
    f = m.first_token_time if m.token_times else None
    e = m.token_times[-1] if m.token_times else None
    record: dict[str, object] = {
        "request_id": client_id,
        "engine_request_id": engine_id,
        "trace_id": trace_id,
        "model": model,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "output_tokens": output_tokens,
        "finish_reason": finish_reason,
        "num_preemptions": m.num_preemptions,
        "arrival_time": s,
        "first_scheduled_time": m.first_scheduled_time,
        "first_token_time": f,
        "last_token_time": e,
        "finished_time": m.finished_time,
        "ttft_s": d.ttft(s, f) if f is not None else None,
        "tpot_s": d.tpot(f, e, len(m.token_times)) if f is not None and e is not None else None,
        "e2e_s": d.e2e(s, e) if e is not None else None,
        "queue_time_s": (
            d.queue_time(s, m.first_scheduled_time) if m.first_scheduled_time is not None else None
        ),
    }
    return record


def log_request(
    out: RequestOutput,
    model: str,
    trace_id: str | None = None,
    logger: logging.Logger = REQUEST_LOGGER,
) -> None:
    """Log the request's record as one compact JSON line at INFO."""
    if logger.isEnabledFor(logging.INFO):
        log_record(request_record(out, model, trace_id), logger)


def log_record(record: dict[str, object], logger: logging.Logger = REQUEST_LOGGER) -> None:
    """Log a record (``request_record``'s or ``failed_record``'s) as one JSON line."""
    logger.info(json.dumps(record, separators=(",", ":")))
