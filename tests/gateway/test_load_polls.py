"""The gateway's load polls and replica health (``kvserve.gateway.replicas.Fleet``),
against real gRPC servers on 127.0.0.1 whose ``GetLoad`` answers, or answers late.

A poll that is merely late no longer takes a replica out at once: in a busy moment
every replica of a model answered one round late together (seen in the rolling-update
test on a loaded machine), each was marked unhealthy, and the gateway answered that
second's requests with 503 "no healthy replica" while both replicas were serving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc

from kvserve.gateway.replicas import SLOW_POLLS_UNHEALTHY, Fleet
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from tests.support.net import free_port

MODEL = "m"
POLL_TIMEOUT_S = 0.3


class LateOnDemand(pb_grpc.EngineServiceServicer):
    """Answers ``GetLoad`` at once, or never while ``late`` is set."""

    def __init__(self) -> None:
        self.late = False

    async def GetLoad(self, request: Any, context: Any) -> pb.GetLoadResponse:
        if self.late:
            await asyncio.Event().wait()  # the poll's deadline ends the call
        return pb.GetLoadResponse(num_running=1, max_model_len=64)


@asynccontextmanager
async def replica() -> AsyncIterator[tuple[str, LateOnDemand]]:
    engine = LateOnDemand()
    server = grpc.aio.server()
    pb_grpc.add_EngineServiceServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", engine
    finally:
        await server.stop(None)


def test_one_late_poll_keeps_a_replica_healthy_and_two_in_a_row_do_not() -> None:
    async def body() -> None:
        async with replica() as (address, engine):
            fleet = Fleet()
            fleet.set_replicas(MODEL, [address], capacity=4)
            rep = fleet.replicas[MODEL][address]
            await fleet.poll_once(POLL_TIMEOUT_S)
            assert rep.healthy and rep.max_model_len == 64

            engine.late = True
            await fleet.poll_once(POLL_TIMEOUT_S)
            assert rep.healthy, "one late poll took the replica out"
            engine.late = False
            await fleet.poll_once(POLL_TIMEOUT_S)
            assert rep.healthy and rep.failures == 0  # the count starts again

            engine.late = True
            for _ in range(SLOW_POLLS_UNHEALTHY):
                await fleet.poll_once(POLL_TIMEOUT_S)
            assert not rep.healthy
            engine.late = False
            await fleet.poll_once(POLL_TIMEOUT_S)
            assert rep.healthy
            await fleet.close()

    asyncio.run(body())


def test_every_replica_late_in_one_round_leaves_the_model_served() -> None:
    async def body() -> None:
        async with replica() as (a, engine_a), replica() as (b, engine_b):
            fleet = Fleet()
            fleet.set_replicas(MODEL, [a, b], capacity=4)
            await fleet.poll_once(POLL_TIMEOUT_S)
            engine_a.late = engine_b.late = True
            await fleet.poll_once(POLL_TIMEOUT_S)
            assert all(rep.healthy for rep in fleet.replicas[MODEL].values())
            await fleet.close()

    asyncio.run(body())


def test_a_replica_that_cannot_be_reached_is_unhealthy_after_one_poll() -> None:
    async def body() -> None:
        nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
        fleet = Fleet()
        fleet.set_replicas(MODEL, [nobody], capacity=4)
        await fleet.poll_once(POLL_TIMEOUT_S)
        assert not fleet.replicas[MODEL][nobody].healthy
        await fleet.close()

    asyncio.run(body())
