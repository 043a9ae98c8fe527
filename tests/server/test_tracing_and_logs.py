"""One span (GenAI attributes, traceparent honoured) and one JSON log line per request."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

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
