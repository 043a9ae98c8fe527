"""A streaming client that stops reading is ended once a write has waited longer than the
write-stall timeout, as if it had disconnected: the response's ``on_close`` runs (which
aborts the engine request) and its events are closed. And a consumer that falls far
behind holds a bounded number of waiting outputs, however many steps it missed.

The response runs on a real event loop with the real watchdog; its ASGI ``send`` is a
client that takes the first writes and then never reads again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from kvserve.engine.async_engine import MERGE_AFTER, AsyncEngine, RequestStream
from kvserve.openai.sse import SSE_DONE, EventStreamResponse
from kvserve.sampling_params import SamplingParams
from tests.support.engine_server import RunningServer, start_server, stop_server

STALL_SECONDS = 0.2


class StopsReading:
    """An ASGI ``send`` whose client reads ``reads`` messages, then never again."""

    def __init__(self, reads: int) -> None:
        self.reads = reads
        self.sent: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        if len(self.sent) >= self.reads:
            await asyncio.Event().wait()  # the socket's buffers are full: wait forever
        self.sent.append(message)


async def never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def run_stream(reads: int, write_timeout: float | None) -> tuple[StopsReading, list[str]]:
    events_closed: list[str] = []
    log: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            for i in range(1000):
                yield f"data: {i}\n\n".encode()
            yield SSE_DONE
        finally:
            events_closed.append("closed")

    async def main() -> StopsReading:
        send = StopsReading(reads)
        response = EventStreamResponse(
            events(), on_close=lambda: log.append("on_close"), write_timeout=write_timeout
        )
        await asyncio.wait_for(response({}, never_disconnects, send), timeout=30)
        return send

    send = asyncio.run(main())
    return send, log + events_closed


def test_a_stalled_write_ends_the_response_as_a_disconnect() -> None:
    send, happened = run_stream(reads=3, write_timeout=STALL_SECONDS)
    assert len(send.sent) == 3  # the start and two chunks, then nothing was read
    assert sorted(happened) == ["closed", "on_close"]  # events closed, request aborted


def test_a_client_that_reads_is_never_ended() -> None:
    send, happened = run_stream(reads=10_000, write_timeout=STALL_SECONDS)
    assert send.sent[-1] == {"type": "http.response.body", "body": SSE_DONE, "more_body": False}
    assert len(send.sent) == 1 + 1000 + 1 and sorted(happened) == ["closed", "on_close"]


@pytest.fixture(scope="module")
def server(checkpoint_dir) -> Iterator[RunningServer]:  # type: ignore[no-untyped-def]
    srv = start_server(checkpoint_dir("llama"))
    yield srv
    stop_server(srv)


async def read_after_the_end(server: RunningServer, stream: RequestStream) -> list[Any]:
    """The stream's outputs, read only once the engine thread has taken its requests and
    run them to the end (nobody reading meanwhile); the stream closed."""
    while not server.engine.requests:
        await asyncio.sleep(0.01)
    while server.engine.requests:
        await asyncio.sleep(0.01)
    got = [out async for out in stream]
    stream.close()
    return got


def test_a_consumer_that_falls_behind_holds_a_bounded_number_of_outputs(
    server: RunningServer,
) -> None:
    """While nobody reads, outputs wait apart up to MERGE_AFTER; later ones absorb the
    last: the reader then gets MERGE_AFTER outputs carrying every token, in order."""

    async def main() -> list[Any]:
        engine = AsyncEngine(server.engine)
        engine.start()
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0, logprobs=2)
            stream = engine.submit(engine.make_request("fall behind", params, "slow-reader"))
            return await read_after_the_end(server, stream)
        finally:
            await engine.stop()

    got = asyncio.run(main())
    assert len(got) == MERGE_AFTER
    c = got[-1].outputs[0]
    assert got[-1].finished and c.finish_reason == "length" and len(c.token_ids) == 200
    assert [t for o in got for t in o.outputs[0].delta_token_ids] == c.token_ids
    assert "".join(o.outputs[0].delta_text for o in got) == c.text
    assert len(c.delta_token_ids) == 200 - (MERGE_AFTER - 1)  # the last absorbed the rest
    assert c.logprobs is not None and len(c.logprobs) == 200
    assert server.engine.kv.pool.num_free_blocks == server.engine.num_kv_blocks


def test_samples_share_one_stream_bounded_per_request_and_closed_together(
    server: RunningServer,
) -> None:
    """The samples of one prompt (``n``) on one stream: unread, they keep at most
    3 × MERGE_AFTER outputs, which carry each one's tokens in order; closing the stream
    before they finish aborts every one of them and frees their blocks."""

    async def main() -> tuple[list[Any], int]:
        engine = AsyncEngine(server.engine)
        engine.start()
        try:
            params = SamplingParams(max_tokens=150, ignore_eos=True, seed=1, n=3)
            reqs = [
                engine.make_request("fall behind", p, "samples", sample_index=i)
                for i, p in enumerate(params.samples())
            ]
            got = await read_after_the_end(server, engine.submit(*reqs))

            cut = engine.submit(*(engine.make_request("cut", p) for p in params.samples()))
            await anext(cut)
            cut.close()  # two samples (at least) still running: all three are aborted
            while server.engine.requests:
                await asyncio.sleep(0.01)
            return got, server.engine.kv.pool.num_free_blocks
        finally:
            await engine.stop()

    got, free = asyncio.run(main())
    assert len(got) <= 3 * MERGE_AFTER
    by_sample = [[o for o in got if o.outputs[0].index == i] for i in range(3)]
    for outs in by_sample:
        c = outs[-1].outputs[0]
        assert outs[-1].finished and len(c.token_ids) == 150
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == c.token_ids
        assert not any(o.finished for o in outs[:-1])
    assert len({tuple(outs[-1].outputs[0].token_ids) for outs in by_sample}) == 3
    assert free == server.engine.num_kv_blocks
