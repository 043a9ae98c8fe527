"""``kvserve bench gateway --phase capacity``'s parts: the stub replica, as a real process
read by the gateway's own upstream client (``ReplicaClient``: one shared ``GenerateMany``),
and the load generator against a real gateway in front of it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvserve.bench.gateway_capacity import offer_load
from kvserve.gateway.config import GatewayConfig
from kvserve.gateway.upstream import ReplicaClient
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc.codec import encode_request
from kvserve.sampling_params import SamplingParams
from tests.support.gateway import KEY_A, keys_file, serve_gateway
from tests.support.stub_replica import stub_replica


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with stub_replica(tmp_path_factory.mktemp("stub")) as address:
        yield address


async def read_all(call: Any) -> list[pb.TaggedOutput]:
    return [out async for out in call]


async def _generate(address: str, max_tokens: int | None, n: int) -> list[list[pb.TaggedOutput]]:
    client = ReplicaClient(address)
    try:
        params = SamplingParams(max_tokens=max_tokens or 16)
        calls = []
        for i in range(n):
            request = encode_request(
                [1, 2, 3], params, request_id=f"r{i}", max_tokens_set=max_tokens is not None
            )
            calls.append(client.generate(request, 30.0, {}))
        return await asyncio.gather(*(read_all(call) for call in calls))
    finally:
        await client.close()


def test_each_request_gets_its_tokens_then_a_final(stub: str) -> None:
    outputs = asyncio.run(_generate(stub, 5, 3))
    for outs in outputs:
        kinds = [o.WhichOneof("kind") for o in outs]
        assert kinds == ["delta"] * 5 + ["final"]
        assert all(o.delta.text == " word" for o in outs[:-1])
        final = outs[-1].final
        assert final.finish_reason == "length"
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 5)


def test_without_max_tokens_the_engine_default_applies(stub: str) -> None:
    (outs,) = asyncio.run(_generate(stub, None, 1))
    assert outs[-1].final.usage.completion_tokens == 16


def test_a_cancelled_request_ends_and_others_go_on(stub: str) -> None:
    async def scenario() -> tuple[list[pb.TaggedOutput], grpc.StatusCode]:
        client = ReplicaClient(stub)
        try:
            params = SamplingParams(max_tokens=1000)
            doomed = client.generate(encode_request([1], params, request_id="doomed"), 30.0, {})
            assert (await doomed.read()).WhichOneof("kind") == "delta"
            doomed.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await doomed.read()
            request = encode_request([1], SamplingParams(max_tokens=2), request_id="other")
            other = client.generate(request, 30.0, {})
            return [out async for out in other], err.value.code()
        finally:
            await client.close()

    outs, code = asyncio.run(scenario())
    assert code == grpc.StatusCode.CANCELLED
    assert [o.WhichOneof("kind") for o in outs] == ["delta", "delta", "final"]


def test_it_refuses_a_port_in_use(tmp_path: Path, stub: str) -> None:
    port = stub.rsplit(":", 1)[1]
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.bench.stub_replica", "--port", port],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert f"stub replica: could not bind the gRPC server to 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_load_generator_counts_chunks_and_failures(stub: str) -> None:
    config = GatewayConfig.model_validate(
        {"models": {"m": {"replicas": [f"grpc://{stub}"]}}, "keys_file": "unused.yaml"}
    )
    gw = serve_gateway(config, keys_file())
    try:
        ok, failed, chunks, error = asyncio.run(offer_load(gw.url, KEY_A, "m", 3, 7, 5))
        assert (ok, failed, chunks, error) == (7, 0, 7 * 5, None)
        # Refused requests: counted, with the first error's status and body, and the
        # connection replaced (the next request still gets its answer).
        ok, failed, chunks, error = asyncio.run(offer_load(gw.url, "sk-wrong", "m", 2, 4, 5))
        assert (ok, failed, chunks) == (0, 4, 0)
        assert error is not None and "401" in error and "invalid_api_key" in error
        ok, failed, _, error = asyncio.run(offer_load(gw.url, KEY_A, "no-such-model", 1, 2, 5))
        assert (ok, failed) == (0, 2) and error is not None and "404" in error
    finally:
        gw.stop()
    # Nothing listening: every request fails, none is left out.
    ok, failed, _, error = asyncio.run(offer_load(gw.url, KEY_A, "m", 2, 5, 5))
    assert (ok, failed) == (0, 5) and error is not None and "ConnectionRefused" in error
