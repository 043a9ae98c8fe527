"""One JSON log line per finished request.

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

from kvserve.outputs import RequestOutput
from kvserve.telemetry import definitions as d

REQUEST_LOGGER = logging.getLogger("kvserve.requests")


def request_record(
    out: RequestOutput, model: str, trace_id: str | None = None
) -> dict[str, object]:
    """A flat, JSON-serialisable summary of one (finished) request."""
    m = out.metrics
    s = m.arrival_time
    f = m.first_token_time if m.token_times else None
    e = m.token_times[-1] if m.token_times else None
    num_output = sum(len(c.token_ids) for c in out.outputs)
    record: dict[str, object] = {
        "request_id": out.client_id,
        "engine_request_id": out.request_id,
        "trace_id": trace_id,
        "model": model,
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.num_cached_tokens,
        "output_tokens": num_output,
        "finish_reason": out.outputs[0].finish_reason if out.outputs else None,
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
    if out.lora_request is not None:  # only under an adapter: base records keep their keys
        record["lora_adapter"] = out.lora_request.lora_name
    return record


def log_request(
    out: RequestOutput,
    model: str,
    trace_id: str | None = None,
    logger: logging.Logger = REQUEST_LOGGER,
) -> None:
    """Log the request's record as one compact JSON line at INFO."""
    if logger.isEnabledFor(logging.INFO):
        record = request_record(out, model, trace_id)
        logger.info(json.dumps(record, separators=(",", ":")))
