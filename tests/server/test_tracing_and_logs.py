"""One span (GenAI attributes, traceparent honoured) and one JSON log line per request."""

from __future__ import annotations

import http.server
import json
import logging
import signal
import threading
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.support.cli_server import start_cli_server
from tests.support.engine_server import SERVED_MODEL as MODEL
from tests.support.engine_server import start_server, stop_server
from tests.support.waiting import wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def test_span_attributes_events_and_request_log(
    checkpoint_dir, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    srv = start_server(checkpoint_dir("llama"), tracer_provider=provider)
    caplog.set_level(logging.INFO, logger="kvserve.requests")
    try:
        with srv.client() as c:
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "temperature": 0.5,
                    "ignore_eos": True,
                },
                headers={"traceparent": PARENT, "x-request-id": "span-test-1"},
            )
            usage = r.json()["usage"]
            c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        wait_until(lambda: len(exporter.get_finished_spans()) == 2)
    finally:
        stop_server(srv)

    chat = next(s for s in exporter.get_finished_spans() if s.name == f"chat {MODEL}")
    assert chat.kind == SpanKind.SERVER
    assert format(chat.context.trace_id, "032x") == TRACE_ID  # continues the caller's trace
    a = chat.attributes or {}
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.request.temperature"] == 0.5
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)  # type: ignore[arg-type]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 4
    assert (
        a["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    )
    assert a["kvserve.request_id"] == "span-test-1"
    names = [e.name for e in chat.events]
    assert names == ["queued", "scheduled", "first_token"]
    stamps = [e.timestamp for e in chat.events]
    assert stamps == sorted(stamps) and chat.start_time <= stamps[0] and stamps[-1] <= chat.end_time
    other = next(s for s in exporter.get_finished_spans() if s.name == f"text_completion {MODEL}")
    assert other.parent is None

    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvserve.requests"]
    mine = next(line for line in lines if line["request_id"] == "span-test-1")
    assert mine["trace_id"] == TRACE_ID and mine["model"] == MODEL
    assert mine["output_tokens"] == 4 and mine["finish_reason"] == "length"
    assert mine["ttft_s"] > 0 and mine["e2e_s"] >= mine["ttft_s"]


def test_the_samples_of_one_request_share_its_trace(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """n = 3 without a traceparent: one trace, the first sample's span the parent of the
    others; with one, all three are children of the caller's span."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    srv = start_server(checkpoint_dir("llama"), tracer_provider=provider)
    try:
        with srv.client() as c:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 3}
            assert c.post("/v1/completions", json=body).status_code == 200
            wait_until(lambda: len(exporter.get_finished_spans()) == 3)
            plain = exporter.get_finished_spans()
            exporter.clear()
            r = c.post("/v1/completions", json=body, headers={"traceparent": PARENT})
            assert r.status_code == 200
            wait_until(lambda: len(exporter.get_finished_spans()) == 3)
            continued = exporter.get_finished_spans()
    finally:
        stop_server(srv)
    assert len({span.context.trace_id for span in plain}) == 1
    [root] = [span for span in plain if span.parent is None]
    assert {span.parent.span_id for span in plain if span is not root} == {  # type: ignore[union-attr]
        root.context.span_id
    }
    assert {format(span.context.trace_id, "032x") for span in continued} == {TRACE_ID}
    assert {format(span.parent.span_id, "016x") for span in continued} == {  # type: ignore[union-attr]
        PARENT.split("-")[2]
    }


def test_no_tracing_configured_is_a_no_op(server) -> None:  # type: ignore[no-untyped-def]
    r = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
    )
    assert r.status_code == 200


def test_grpc_request_continues_the_gateways_trace(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    import grpc

    from kvserve.rpc import engine_pb2 as pb
    from kvserve.rpc import engine_pb2_grpc as pb_grpc

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    srv = start_server(checkpoint_dir("llama"), tracer_provider=provider, grpc=True)
    try:

        async def call() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
                stub = pb_grpc.EngineServiceStub(channel)
                req = pb.GenerateRequest(request_id="grpc-span-1", prompt_text="hi", max_tokens=2)
                async for _ in stub.Generate(req, metadata=(("traceparent", PARENT),)):
                    pass

        asyncio.run(call())
        wait_until(lambda: len(exporter.get_finished_spans()) == 1)
    finally:
        stop_server(srv)
    [span] = exporter.get_finished_spans()
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert (span.attributes or {})["kvserve.request_id"] == "grpc-span-1"
    assert (span.attributes or {})["gen_ai.usage.output_tokens"] == 2


class _OTLPReceiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver on 127.0.0.1: keeps every span posted to /v1/traces."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        super().__init__(("127.0.0.1", 0), _OTLPHandler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _OTLPHandler(http.server.BaseHTTPRequestHandler):
    server: _OTLPReceiver

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        body = self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/v1/traces":
            export = ExportTraceServiceRequest.FromString(body)
            for resource in export.resource_spans:
                for scope in resource.scope_spans:
                    self.server.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_spans_reach_an_otlp_endpoint_from_the_cli_server(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """The standard OTEL_EXPORTER_OTLP_ENDPOINT: `kvserve serve` starts, and a request's
    span arrives at the endpoint over OTLP/HTTP (the exporter's import and encoding are
    those of the installed packages, not an in-memory stand-in)."""
    receiver = _OTLPReceiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    proc, url, _ = start_cli_server(checkpoint_dir("llama"), env=env)
    try:
        body = {"model": "m", "prompt": "x", "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"x-request-id": "otlp-1"})
        assert r.status_code == 200, r.text

        def request_ids() -> list[str]:
            return [
                a.value.string_value
                for span in list(receiver.spans)
                for a in span.attributes
                if a.key == "kvserve.request_id"
            ]

        wait_until(lambda: "otlp-1" in request_ids())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.tail()
    except BaseException:
        print(proc.tail())
        raise
    finally:
        proc.kill()
        receiver.shutdown()
        receiver.server_close()
