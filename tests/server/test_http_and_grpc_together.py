"""kvserve's app serves HTTP and gRPC from one engine, on one event loop."""

from __future__ import annotations

import asyncio

import grpc
import httpx

from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from tests.support.engine_server import SERVED_MODEL as MODEL
from tests.support.engine_server import start_server, stop_server


def test_grpc_and_http_share_the_engine(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    srv = start_server(checkpoint_dir("llama"), grpc=True)
    try:
        assert srv.grpc_port

        async def via_grpc() -> tuple[list[int], str]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
                stub = pb_grpc.EngineServiceStub(channel)
                ids: list[int] = []
                reason = ""
                req = pb.GenerateRequest(
                    request_id="both-1",
                    prompt_text="the cache keeps",
                    max_tokens=5,
                    temperature=0,
                    ignore_eos=True,
                )
                async for msg in stub.Generate(req):
                    if msg.HasField("delta"):
                        ids.extend(msg.delta.token_ids)
                    else:
                        reason = msg.final.finish_reason
                load = await stub.GetLoad(pb.GetLoadRequest())
                assert load.num_running == 0 and load.block_size == 16
                return ids, reason

        ids, reason = asyncio.run(via_grpc())
        r = httpx.post(
            f"{srv.url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": "the cache keeps",
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert reason == "length" and len(ids) == 5
        assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        stop_server(srv)
