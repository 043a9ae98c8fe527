"""One OpenTelemetry span and one JSON log line per request the engine takes in (a
refusal before it gets neither: README, "Telemetry").

The span starts when the server receives the request (continuing the caller's W3C
``traceparent``) and ends when the engine reports the request finished — also when it
was aborted because the client left. Attributes follow the GenAI semantic conventions;
the timeline instants become span events. Spans go over OTLP when the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; otherwise tracing is a no-op.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagate import extract
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvserve.outputs import RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.telemetry.request_log import REQUEST_LOGGER, failed_record, log_record, log_request

if TYPE_CHECKING:
    from kvserve.engine.request import Request

log = logging.getLogger(__name__)


def otlp_problem() -> str | None:
    """Why the OTLP export that OTEL_EXPORTER_OTLP_ENDPOINT asks for cannot work, or None
    (the servers check it before loading anything: a broken install fails at once)."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http import trace_exporter  # noqa: F401
    except ImportError as exc:
        return (
            f"OTEL_EXPORTER_OTLP_ENDPOINT is set, but the OTLP exporter cannot be imported "
            f"({exc}); reinstall opentelemetry-proto and opentelemetry-exporter-otlp-proto-http, "
            "or unset the variable"
        )
    return None


def tracer_provider_from_env(service_name: str = "kvserve-engine") -> trace.TracerProvider:
    """An OTLP-exporting provider when OTEL_EXPORTER_OTLP_ENDPOINT is set, else no-op."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return trace.NoOpTracerProvider()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


# Engine timeline instants are monotonic; spans want wall-clock nanoseconds. One offset
# for the process keeps a span's start and its events in the same order as the timeline.
_WALL_MINUS_MONOTONIC_NS = time.time_ns() - time.monotonic_ns()


def _epoch_ns(monotonic_s: float) -> int:
    return _WALL_MINUS_MONOTONIC_NS + int(monotonic_s * 1e9)


@dataclass
class _InFlight:
    span: Span
    trace_id: str | None


class RequestTelemetry:
    """Begin a request's span on the event loop; finish it from the engine thread."""

    def __init__(self, model: str, provider: trace.TracerProvider | None = None) -> None:
        self.model = model
        self.tracer = (provider or trace.NoOpTracerProvider()).get_tracer("kvserve")
        self._inflight: dict[str, _InFlight] = {}
        self._lock = threading.Lock()

    def begin(
        self,
        request_id: str,
        operation: str,  # "chat" | "text_completion"
        params: SamplingParams,
        headers: Mapping[str, str],
        arrival: float,
        external_id: str | None = None,
        lora_adapter: str | None = None,
        parent: Context | None = None,
    ) -> Context:
        """Start the span, a child of the caller's traceparent in ``headers`` (or of
        ``parent`` if given). Returns the parent of the request's further samples (``n``
        > 1, a batch of prompts), so that all are in one trace: the caller's context, or
        without a traceparent, this span's.

        ``request_id`` is the engine's id (the key until ``finish``); ``external_id`` the
        client's, which the span shows as ``kvserve.request_id``. ``lora_adapter``: the
        LoRA adapter the client asked for (its ``model``), shown as
        ``kvserve.lora_adapter`` and as ``gen_ai.request.model``.
        """
        attributes: dict[str, str | int | float] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": lora_adapter or self.model,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "kvserve.request_id": request_id if external_id is None else external_id,
            "kvserve.engine_request_id": request_id,
        }
        if lora_adapter is not None:
            attributes["kvserve.lora_adapter"] = lora_adapter
        caller = extract(dict(headers)) if parent is None else parent
        span = self.tracer.start_span(
            f"{operation} {lora_adapter or self.model}",
            context=caller,
            kind=SpanKind.SERVER,
            start_time=_epoch_ns(arrival),
            attributes=attributes,
        )
        ctx = span.get_span_context()
        trace_id = format(ctx.trace_id, "032x") if ctx.is_valid else None
        with self._lock:
            self._inflight[request_id] = _InFlight(span, trace_id)
        if trace.get_current_span(caller).get_span_context().is_valid:
            return caller
        return trace.set_span_in_context(span)

    def trace_id(self, request_id: str) -> str | None:
        with self._lock:
            entry = self._inflight.get(request_id)
        return entry.trace_id if entry else None

    def finish(self, out: RequestOutput) -> None:
        """The engine finished (or aborted) the request: close its span, log its line."""
        with self._lock:
            entry = self._inflight.pop(out.request_id, None)
        trace_id = entry.trace_id if entry else None
        log_request(out, self.model, trace_id)
        if entry is None:
            return
        c = out.outputs[0]
        _end_span(
            entry.span,
            c.finish_reason or "unknown",
            (len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens),
            out.metrics,
        )

    def fail(self, req: Request, message: str) -> None:
        """The request failed in the engine: close its span with the error, and log its
        line (finish reason "error"), as ``finish`` does for one that ended normally."""
        with self._lock:
            entry = self._inflight.pop(req.request_id, None)
        trace_id = entry.trace_id if entry else None
        if REQUEST_LOGGER.isEnabledFor(logging.INFO):
            log_record(failed_record(req, self.model, trace_id))
        if entry is None:
            return
        entry.span.set_status(Status(StatusCode.ERROR, message))
        entry.span.set_attribute("error.type", "request_failed")
        tokens = (req.num_prompt_tokens, req.num_output_tokens, max(req.num_cached_tokens, 0))
        _end_span(entry.span, "error", tokens, req.metrics)


def _end_span(
    span: Span, finish_reason: str, tokens: tuple[int, int, int], m: RequestMetrics
) -> None:
    """The request's outcome on its span (``tokens``: prompt, output, cached), its
    timeline as events, and the span's end at its last token."""
    prompt_tokens, output_tokens, cached_tokens = tokens
    span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
    span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
    span.set_attribute("gen_ai.usage.cache_read.input_tokens", cached_tokens)
    span.set_attribute("kvserve.num_preemptions", m.num_preemptions)
    span.add_event("queued", timestamp=_epoch_ns(m.arrival_time))
    if m.first_scheduled_time is not None:
        span.add_event("scheduled", timestamp=_epoch_ns(m.first_scheduled_time))
    if m.first_token_time is not None:
        span.add_event("first_token", timestamp=_epoch_ns(m.first_token_time))
    end = m.token_times[-1] if m.token_times else (m.finished_time or time.monotonic())
    span.end(end_time=_epoch_ns(max(end, m.finished_time or end)))
