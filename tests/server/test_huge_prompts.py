"""Prompts too long to fit are refused before they are tokenized, and long prompts are
tokenized off the event loop, over HTTP and gRPC alike."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import httpx
import pytest

from kvserve.engine.async_engine import OFFLOAD_CHARS
from kvserve.rpc import codec
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from kvserve.server.app import body_limit
from tests.support.engine_server import SERVED_MODEL as MODEL
from tests.support.engine_server import RunningServer, start_server, stop_server

MEGABYTE = 1 << 20


@pytest.fixture(scope="module")
def big_body_server(checkpoint_dir) -> Iterator[RunningServer]:  # type: ignore[no-untyped-def]
    srv = start_server(checkpoint_dir("llama"), grpc=True, max_body_bytes=4 * MEGABYTE)
    yield srv
    stop_server(srv)


def post(srv: RunningServer, path: str, body: dict[str, object]) -> httpx.Response:
    with srv.client() as c:
        return c.post(path, json={"model": MODEL, "max_tokens": 2, **body})


def test_a_body_of_megabytes_is_refused_before_it_is_read(
    big_body_server: RunningServer,
) -> None:
    """No prompt that long could fit, so the body limit (4 MiB configured) shrinks to what
    the longest prompt may take, and the Content-Length alone is refused."""
    limit = big_body_server.engine.max_prompt_chars
    assert limit is not None
    r = post(big_body_server, "/v1/completions", {"prompt": "x" * (3 * MEGABYTE)})
    assert r.status_code == 413, r.text
    assert f"limit of {body_limit(4 * MEGABYTE, big_body_server.engine)}" in r.text
    assert body_limit(4 * MEGABYTE, big_body_server.engine) < MEGABYTE


def test_a_prompt_longer_than_can_fit_is_refused_by_its_length(
    big_body_server: RunningServer,
) -> None:
    limit = big_body_server.engine.max_prompt_chars
    assert limit is not None
    for path, body, param in [
        ("/v1/completions", {"prompt": "y" * (limit + 1)}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "z" * (limit + 1)}]},
            "messages",
        ),
    ]:
        r = post(big_body_server, path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param
        assert f"at most {limit} characters" in error["message"]


def test_a_long_prompt_is_tokenized_then_checked(big_body_server: RunningServer) -> None:
    limit = big_body_server.engine.max_prompt_chars
    assert limit is not None and limit > OFFLOAD_CHARS
    words = "hello world " * ((OFFLOAD_CHARS + 1000) // 12)  # tokenized off the loop
    r = post(big_body_server, "/v1/completions", {"prompt": words})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
    assert "tokens" in r.json()["error"]["message"]  # the token count's refusal
    short = post(big_body_server, "/v1/completions", {"prompt": "hello world " * 40})
    assert short.status_code == 200, short.text


def test_grpc_refuses_a_prompt_of_megabytes_by_its_length(
    big_body_server: RunningServer,
) -> None:
    async def call() -> grpc.aio.AioRpcError:
        address = f"127.0.0.1:{big_body_server.grpc_port}"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            request = pb.GenerateRequest(prompt_text="x" * (3 * MEGABYTE), max_tokens=2)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(request):
                    pass
            return info.value

    error = asyncio.run(call())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert codec.error_fields(error.trailing_metadata())[0] == "prompt"
    assert "characters" in (error.details() or "")
