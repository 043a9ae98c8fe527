"""An ``AsyncEngine`` behind a grpc.aio server on a loopback port, on one event loop.

``serve(engine, body)`` runs ``body(Served)`` against a fresh one, and checks at the end
that nothing was left behind in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from kvserve.server.grpc_service import start_grpc_server
from tests.support.waiting import eventually

PROMPT = "the cache keeps keys and values"
BLOCK_SIZE = 4
LONG = 500  # output tokens: far more than any test lets run (~20 ms a step on CPU)


@dataclass
class Served:
    engine: AsyncEngine
    stub: Any  # pb_grpc.EngineServiceStub (generated, untyped)
    port: int
    server: grpc.aio.Server

    async def stop_server(self) -> None:
        """Stop serving gRPC at once (cancelling every call), as a replica that dies."""
        await self.server.stop(None)

    def is_idle(self) -> bool:
        """No request left in the engine and every KV block free."""
        core = self.engine.engine
        return not core.requests and core.kv.pool.num_free_blocks == core.num_kv_blocks

    def client_ids(self) -> list[str]:
        """The client ids of the requests in the engine (its keys are its own ids)."""
        return sorted(r.external_id or "" for r in self.engine.engine.requests.values())


def serve(
    llm_engine: LLMEngine, body: Callable[[Served], Awaitable[None]], **server_kw: Any
) -> None:
    """Run ``body`` against a fresh AsyncEngine + gRPC server on one event loop."""

    async def main() -> None:
        engine = AsyncEngine(llm_engine)
        engine.start()
        server, port = await start_grpc_server(engine, "127.0.0.1", 0, **server_kw)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                served = Served(engine, pb_grpc.EngineServiceStub(channel), port, server)
                await asyncio.wait_for(body(served), timeout=60)
                # Whatever the test did, nothing may be left behind in the engine.
                await eventually(served.is_idle)
        finally:
            await server.stop(None)
            await engine.stop()

    asyncio.run(main())


def request(request_id: str, max_tokens: int, **kw: Any) -> pb.GenerateRequest:
    """A greedy request that ignores EOS (so it produces exactly max_tokens tokens)."""
    kw.setdefault("prompt_text", PROMPT)
    return pb.GenerateRequest(
        request_id=request_id, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw
    )
