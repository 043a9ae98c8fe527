"""The gateway's side of the engine's gRPC API: one client per replica.

Requests and outputs are converted by ``kvserve.rpc.codec``. Sampling values are
validated at the gateway with the engine's own ``SamplingParams`` (a bad value is a 400
there, named as the engine names it); the engine validates again, which costs nothing and
keeps each side honest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from kvserve.gateway.multiplex import Multiplexer, UpstreamRequest
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from kvserve.rpc.listen import MAX_MESSAGE_BYTES

# Keep idle connections warm through load balancers and notice dead replicas quickly
# (the replica's server accepts pings this often: kvserve.rpc.listen).
KEEPALIVE_TIME_MS = 30_000


def _channel_options(keepalive_ms: int) -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]


class ReplicaClient:
    """A channel to one engine replica (``host:port``) and the calls the gateway makes.

    Requests share one ``GenerateMany`` call (``kvserve.gateway.multiplex``).
    """

    def __init__(self, address: str, keepalive_ms: int = KEEPALIVE_TIME_MS) -> None:
        self.address = address
        options = _channel_options(keepalive_ms)
        self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = pb_grpc.EngineServiceStub(self._channel)
        self._requests = Multiplexer(self._stub, address)

    def generate(
        self, request: pb.GenerateRequest, timeout: float, metadata: Mapping[str, str]
    ) -> UpstreamRequest:
        """Start ``request`` on the shared call; ``cancel()`` the result to abort it."""
        return self._requests.start(request, timeout, metadata)

    def fail_unanswered(self, why: str) -> int:
        """End the requests this replica has sent no output yet as its failure (UNAVAILABLE
        ``why``; the caller may retry them elsewhere) and cancel them there; how many."""
        return self._requests.fail_unanswered(why)

    async def get_load(self, timeout: float) -> Any:
        return await self._stub.GetLoad(pb.GetLoadRequest(), timeout=timeout)

    async def load_lora_adapter(self, name: str, timeout: float) -> Any:
        """Have the replica load the adapter ``name`` from its ``--lora-dir/<name>`` (an
        empty ``lora_path`` says so)."""
        request = pb.LoadLoRAAdapterRequest(lora_name=name, lora_path="")
        return await self._stub.LoadLoRAAdapter(request, timeout=timeout)

    async def close(self) -> None:
        self._requests.close()
        await self._channel.close()
