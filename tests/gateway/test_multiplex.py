"""The gateway's shared ``GenerateMany`` call, against a real engine and gRPC server.

Each test runs on its own event loop with a real ``AsyncEngine`` and grpc.aio server on a
loopback port (``tests.support.grpc_engine.serve``); the client under test is the gateway's
``ReplicaClient``.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.gateway.multiplex import batches
from kvserve.gateway.upstream import KEEPALIVE_TIME_MS, ReplicaClient
from kvserve.rpc import codec
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc.listen import MIN_PING_INTERVAL_MS
from tests.support.grpc_engine import BLOCK_SIZE, LONG, Served, request, serve
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def engine(checkpoint_dir: Callable[[str], Path]) -> Iterator[LLMEngine]:
    cfg = EngineConfig(
        model=str(checkpoint_dir("llama")),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
    )
    yield LLMEngine(cfg)


async def read_all(upstream: Any) -> list[Any]:
    return [out async for out in upstream]


def test_requests_share_one_call_and_match_their_own_generate_calls(engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        client = ReplicaClient(f"127.0.0.1:{s.port}")
        try:
            lengths = [3, 7, 5]
            upstreams = [
                client.generate(request(f"shared-{i}", n), 30, {"x-request-id": f"shared-{i}"})
                for i, n in enumerate(lengths)
            ]
            results = await asyncio.gather(*(read_all(u) for u in upstreams))
            for i, (outputs, n) in enumerate(zip(results, lengths, strict=True)):
                alone = [r async for r in s.stub.Generate(request(f"alone-{i}", n))]
                assert [o.WhichOneof("kind") for o in outputs] == [
                    r.WhichOneof("kind") for r in alone
                ]
                assert [list(o.delta.token_ids) for o in outputs[:-1]] == [
                    list(r.delta.token_ids) for r in alone[:-1]
                ]
                assert outputs[-1].final.usage.completion_tokens == n
            assert len({u.tag for u in upstreams}) == 3
            # After the final, reading again is the end of the stream.
            assert await upstreams[0].read() is grpc.aio.EOF
        finally:
            await client.close()

    serve(engine, body)


def test_cancel_aborts_one_request_and_leaves_the_others_running(engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        client = ReplicaClient(f"127.0.0.1:{s.port}")
        try:
            doomed = client.generate(request("doomed", LONG), 30, {})
            survivor = client.generate(request("survivor", 12), 30, {})
            assert (await doomed.read()).WhichOneof("kind") == "delta"
            doomed.cancel()
            await eventually(lambda: "doomed" not in s.engine.engine.requests)
            outputs = await read_all(survivor)
            assert outputs[-1].final.finish_reason == "length"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await doomed.read()
            assert info.value.code() == grpc.StatusCode.CANCELLED
        finally:
            await client.close()

    serve(engine, body)


def test_a_deadline_aborts_the_request_on_the_replica(engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        client = ReplicaClient(f"127.0.0.1:{s.port}")
        try:
            slow = client.generate(request("slow", LONG), 0.5, {})
            seen = 0
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for out in slow:
                    assert out.WhichOneof("kind") == "delta"
                    seen += 1
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert seen > 0
            await eventually(s.is_idle)
        finally:
            await client.close()

    serve(engine, body)


def test_an_engine_refusal_fails_only_that_request(engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        client = ReplicaClient(f"127.0.0.1:{s.port}")
        try:
            good = client.generate(request("good", 4), 30, {})
            bad = client.generate(request("bad", 0), 30, {})
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await bad.read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert codec.error_fields(info.value.trailing_metadata())[0] == "max_tokens"
            assert (await read_all(good))[-1].final.usage.completion_tokens == 4
        finally:
            await client.close()

    serve(engine, body)


def test_a_replica_that_goes_away_fails_its_requests_and_the_next_call_is_new(
    engine: LLMEngine,
) -> None:
    async def body(s: Served) -> None:
        client = ReplicaClient(f"127.0.0.1:{s.port}")
        try:
            first = client.generate(request("cut-off", LONG), 30, {})
            assert (await first.read()).WhichOneof("kind") == "delta"
            await s.stop_server()
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in first:
                    pass
            await eventually(s.is_idle)  # the replica aborted what the call had started
            later = client.generate(request("later", 4), 30, {})  # a new call, refused
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await later.read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert later.tag != first.tag
        finally:
            await client.close()

    serve(engine, body)


def test_a_call_the_replica_ended_leaves_nothing_running_or_to_collect(
    engine: LLMEngine,
) -> None:
    """grpc.aio reads a call's commands in a task of its own, which it cancels only when
    the gateway cancels the call. When the replica ends it (stopped, or drained), that
    task must end too: left waiting, it and its generator were collected mid-await, and
    asyncio logged "Task exception was never retrieved ... RuntimeError('aclose():
    asynchronous generator is already running')"."""

    def command_readers() -> list[asyncio.Task[Any]]:
        return [
            task
            for task in asyncio.all_tasks()
            if "_consume_request_iterator" in getattr(task.get_coro(), "__qualname__", "")
        ]

    async def body(s: Served) -> None:
        reported: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx))
        client = ReplicaClient(f"127.0.0.1:{s.port}")
        try:
            first = client.generate(request("cut-off", LONG), 30, {})
            assert (await first.read()).WhichOneof("kind") == "delta"
            assert len(command_readers()) == 1
            await s.stop_server()
            with pytest.raises(grpc.aio.AioRpcError):
                await read_all(first)
            later = client.generate(request("later", 4), 30, {})  # on a new call
            with pytest.raises(grpc.aio.AioRpcError):
                await later.read()
            await eventually(lambda: not command_readers())
            del first, later  # the ended calls' last references
            gc.collect()
            await asyncio.sleep(0)  # a turn for what the collection scheduled (aclose())
            gc.collect()
            assert reported == []
        finally:
            await client.close()

    serve(engine, body)


@pytest.mark.slow
def test_an_idle_shared_call_outlives_the_gateways_keepalive_pings(engine: LLMEngine) -> None:
    # Scaled down: the gateway pings every 30 s and the replica accepts one every 10 s.
    # With gRPC's default server settings (a ping without data at most every 5 minutes)
    # this fails: after three early pings the replica sends GOAWAY "too_many_pings".
    assert MIN_PING_INTERVAL_MS < KEEPALIVE_TIME_MS
    keepalive_ms, idle_s = 1000, 5.0

    async def body(s: Served) -> None:
        client = ReplicaClient(f"127.0.0.1:{s.port}", keepalive_ms=keepalive_ms)
        try:
            first = client.generate(request("before-idle", 2), 30, {})
            await read_all(first)
            # The idle time is the scenario (pings with no data), not a synchronisation.
            await asyncio.sleep(idle_s)
            second = client.generate(request("after-idle", 2), 30, {})
            assert (await read_all(second))[-1].final.usage.completion_tokens == 2
            assert client._requests.num_calls == 1  # the same call, never broken
        finally:
            await client.close()

    serve(engine, body, min_ping_interval_ms=keepalive_ms // 2)


def test_commands_are_cut_into_messages_under_the_limit_in_order() -> None:
    commands = [
        pb.TaggedCommand(tag=i, start=pb.GenerateRequest(prompt_text="x" * size))
        for i, size in enumerate([100, 100, 5000, 100, 100, 100])
    ]
    runs = batches(commands, 1000)
    assert [[c.tag for c in run] for run in runs] == [[0, 1], [2], [3, 4, 5]]
    for run in runs:
        size = pb.GenerateManyRequest(commands=run).ByteSize()
        assert size <= 1000 or len(run) == 1  # an oversized command travels alone
    assert batches([], 1000) == []
