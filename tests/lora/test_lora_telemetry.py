"""The adapter's name on spans and request log lines, ``kvserve_lora_requests_info``, and
the per-adapter request counters."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.llm_engine import EngineStats
from kvserve.lora import LoRARequest
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.telemetry.prometheus import EngineMetrics
from kvserve.telemetry.request_log import request_record
from kvserve.telemetry.tracing import RequestTelemetry

ADAPTER = LoRARequest("sql", "/adapters/sql")


def finished(lora: LoRARequest | None) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.1)
    metrics.first_token_time, metrics.token_times, metrics.finished_time = 1.2, [1.2], 1.2
    return RequestOutput(
        "req-0",
        None,
        [1, 2],
        [CompletionOutput(0, "x", [3], "length")],
        True,
        0,
        metrics,
        lora_request=lora,
    )


def test_the_request_log_names_the_adapter() -> None:
    assert request_record(finished(ADAPTER), "base")["lora_adapter"] == "sql"
    assert "lora_adapter" not in request_record(finished(None), "base")


def test_the_span_names_the_adapter() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = RequestTelemetry("base", provider)
    telemetry.begin("req-0", "text_completion", SamplingParams(), {}, 1.0, None, "sql")
    telemetry.finish(finished(ADAPTER))
    [span] = exporter.get_finished_spans()
    assert span.name == "text_completion sql"
    assert span.attributes is not None
    assert span.attributes["kvserve.lora_adapter"] == "sql"
    assert span.attributes["gen_ai.request.model"] == "sql"


def lora_samples(metrics: EngineMetrics) -> list[dict[str, str]]:
    text = metrics.render()[0].decode()
    return [
        s.labels
        for f in text_string_to_metric_families(text)
        if f.name == "kvserve_lora_requests_info"
        for s in f.samples
    ]


def test_lora_requests_info_has_one_series_the_current_one() -> None:
    metrics = EngineMetrics("base")
    metrics.observe_engine(EngineStats(0, 0, 0.0, 10, 0, 0, 0))
    assert lora_samples(metrics) == []  # LoRA off: no series
    metrics.observe_engine(EngineStats(2, 1, 0.1, 10, 0, 0, 0, 4, ("a", "b"), ("c",)))
    metrics.observe_engine(EngineStats(1, 0, 0.1, 10, 0, 0, 0, 4, ("a",), ()))
    assert lora_samples(metrics) == [
        {
            "model": "base",
            "max_lora": "4",
            "running_lora_adapters": "a",
            "waiting_lora_adapters": "",
        }
    ]


def lora_counts(metrics: EngineMetrics) -> dict[str, float]:
    text = metrics.render()[0].decode()
    return {
        s.labels["lora_adapter"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "kvserve_lora_requests"
        for s in f.samples
        if s.name == "kvserve_lora_requests_total"
    }


def test_per_adapter_counters_keep_only_the_adapters_the_engine_can_hold() -> None:
    metrics = EngineMetrics("base")
    metrics.observe_finished(finished(ADAPTER))
    assert lora_counts(metrics) == {}  # LoRA off (no limit set): no series at all
    metrics.set_lora_limit(2)
    for name in ("a", "b", "a", "c"):  # c drops b, the least recently counted
        metrics.observe_finished(finished(LoRARequest(name, f"/adapters/{name}")))
    metrics.observe_finished(finished(None))  # the base model: not an adapter series
    assert lora_counts(metrics) == {"a": 2.0, "c": 1.0}
