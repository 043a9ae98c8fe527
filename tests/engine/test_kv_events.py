"""KV-cache events: what a vLLM consumer decodes from kvserve's publisher.

The decoder below is written from the field order of vLLM's
``vllm/distributed/kv_events.py`` (its trailing optional fields included, unknown fields
forbidden), not imported from kvserve: it is what llm-d's and Dynamo's decoders read.
Every socket is real, on 127.0.0.1. ZMQ's PUB socket drops what it sends before a
subscriber's connection is up, so each test first *joins*: it sends probe requests until
the subscriber receives one, after which every batch arrives, in order; what came before
is fetched through the replay socket.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_cache_manager import hash_block
from kvserve.engine.kv_events import (
    AllBlocksCleared,
    BlockStored,
    KVEventPublisher,
    start_kv_events,
)
from kvserve.telemetry.prometheus import EngineMetrics
from tests.support.cli_server import start_cli_server
from tests.support.fresh_python import heavy_modules_after
from tests.support.net import free_port
from tests.support.waiting import wait_until

BLOCK = 4
RECV_TIMEOUT_MS = 10_000


# ---- a consumer's decoder, from vLLM's field order --------------------------------------
class VllmEvent(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(VllmBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """A SUB socket bound on 127.0.0.1 (the engine's PUB connects to it)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.received: list[tuple[bytes, int, VllmBatch]] = []

    def recv(self, timeout_ms: int) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq, payload = self.sub.recv_multipart()
        self.received.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
        return True

    def join(self, llm: LLM) -> int:
        """Probe until a batch arrives live; the sequence number after it."""
        probe = 0
        while not self.received:
            probe += 1
            assert probe < 200, "no batch reached the subscriber"
            prompt = [10 + probe, 1, 2, 3]  # a full block never cached before: one batch
            llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
            self.recv(timeout_ms=50)
        return self.received[-1][1] + 1

    def until(self, publisher: KVEventPublisher) -> list[VllmBatch]:
        """Every batch published so far that this subscriber has not read yet, in order;
        their sequence numbers must follow each other."""
        start = len(self.received)
        while not self.received or self.received[-1][1] < publisher.next_seq - 1:
            assert self.recv(RECV_TIMEOUT_MS), "a published batch did not arrive"
        seqs = [seq for _, seq, _ in self.received]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        return [batch for _, _, batch in self.received[start:]]


def replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[int]:
    """Ask the replay socket for the batches from ``start``; their sequence numbers."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        seqs = []
        while True:
            assert dealer.poll(RECV_TIMEOUT_MS), "the replay did not answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return seqs
            DECODER.decode(payload)
            seqs.append(int.from_bytes(seq, "big"))
    finally:
        dealer.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def events_llm(checkpoint_dir, ctx) -> Iterator[tuple[LLM, Subscriber, str]]:  # type: ignore[no-untyped-def]
    sub = Subscriber(ctx)
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    llm = LLM(
        str(checkpoint_dir("llama")),
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=12,
        kv_events_endpoint=sub.endpoint,
        kv_events_replay_endpoint=replay_endpoint,
        kv_events_topic="kv@pod-0@m",
    )
    yield llm, sub, replay_endpoint
    assert llm.engine.kv_events is not None
    llm.engine.kv_events.close()


def apply(view: set[bytes | int], batches: list[VllmBatch]) -> None:
    """A consumer's view of the replica's cache: stored minus removed."""
    for batch in batches:
        for ev in batch.events:
            if isinstance(ev, VllmBlockStored):
                view.update(ev.block_hashes)
            elif isinstance(ev, VllmBlockRemoved):
                view.difference_update(ev.block_hashes)
            else:
                view.clear()


ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def test_block_stored_carries_hashes_parents_and_tokens(events_llm, ctx) -> None:  # type: ignore[no-untyped-def]
    llm, sub, replay_endpoint = events_llm
    pub = llm.engine.kv_events
    joined = sub.join(llm)
    sub.until(pub)

    first = list(range(10, 21))  # 11 tokens: two full blocks
    llm.generate([first], ONE, use_tqdm=False)
    (batch,) = sub.until(pub)
    assert batch.data_parallel_rank == 0 and batch.ts > 0
    (stored,) = batch.events
    h0 = hash_block(None, first[:BLOCK], None)
    h1 = hash_block(h0, first[BLOCK : 2 * BLOCK], None)
    assert stored == VllmBlockStored([h0, h1], None, first[: 2 * BLOCK], BLOCK, None, "CPU", None)

    # Sharing the first block: only the second, new one is stored, under its parent.
    second = first[:BLOCK] + list(range(50, 57))
    llm.generate([second], ONE, use_tqdm=False)
    (batch,) = sub.until(pub)
    (stored,) = batch.events
    assert isinstance(stored, VllmBlockStored)
    assert stored.parent_block_hash == h0
    assert stored.token_ids == second[BLOCK : 2 * BLOCK]
    assert stored.block_hashes == [hash_block(h0, second[BLOCK : 2 * BLOCK], None)]
    assert {topic for topic, _, _ in sub.received} == {b"kv@pod-0@m"}

    # A subscriber that joins late gets every batch from the replay socket, the probes
    # sent before the live subscriber's connection was up included.
    assert replay(ctx, replay_endpoint, 0) == list(range(pub.next_seq))
    assert replay(ctx, replay_endpoint, joined) == list(range(joined, pub.next_seq))
    assert pub.dropped_batches == 0


def test_the_consumers_view_is_the_cache_through_eviction_and_reset(events_llm) -> None:  # type: ignore[no-untyped-def]
    llm, sub, _ = events_llm
    pub = llm.engine.kv_events
    pool = llm.engine.kv.pool
    sub.join(llm)
    sub.until(pub)
    view: set[bytes | int] = set(pool.cached)  # what the probes left, already known

    # 12 blocks: each prompt caches 2 and holds 3 while running, so later prompts evict.
    removed = 0
    for i in range(8):
        llm.generate([list(range(20 + 11 * i, 31 + 11 * i))], ONE, use_tqdm=False)
        batches = sub.until(pub)
        removed += sum(isinstance(e, VllmBlockRemoved) for b in batches for e in b.events)
        apply(view, batches)
        assert view == set(pool.cached)
    assert removed > 0

    llm.engine.reset_prefix_cache()
    (batch,) = sub.until(pub)
    assert batch.events == [VllmAllBlocksCleared()]
    apply(view, [batch])
    assert view == set(pool.cached) == set()


def test_a_bound_publisher_batches_in_order(tmp_path: Path, ctx) -> None:  # type: ignore[no-untyped-def]
    from kvserve.engine.block_pool import BlockPool

    pool = BlockPool(1)  # so the block freed is the next one allocated
    endpoint = f"ipc://{tmp_path}/events"  # bound, as tcp://*:PORT is
    pub = start_kv_events(endpoint, None, None, pool=pool, block_size=BLOCK, device_type="cuda")
    assert pub is not None and pool.events is pub.recorder
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        # Join: probe (a reset) until one arrives.
        while not sub.poll(50):
            pool.reset_prefix_cache()
            pub.end_step()
        probes = pub.next_seq
        block = pool.allocate(1)[0]
        pool.cache_block(block, b"h")
        pool.free([block])
        pool.free(pool.allocate(1))  # the LRU front is the cached block: evicted
        pub.end_step()
        pub.end_step()  # nothing recorded: nothing sent
        assert pool.reset_prefix_cache()
        pub.end_step()
        batches = {}
        while len(batches) < 2:
            assert sub.poll(RECV_TIMEOUT_MS)
            _, seq, payload = sub.recv_multipart()
            if int.from_bytes(seq, "big") >= probes:  # the probes' batches may still come
                batches[int.from_bytes(seq, "big")] = DECODER.decode(payload).events
        assert batches == {
            probes: [VllmBlockRemoved([b"h"], "GPU")],
            probes + 1: [VllmAllBlocksCleared()],
        }
    finally:
        sub.close()
        pub.close()


class StallPublisherThread(logging.Handler):
    """Holds the publisher's thread inside a log call until ``release`` is set: a thread
    busy elsewhere, as one starved of CPU is, while the engine thread keeps publishing.
    ``handle`` is overridden (not ``emit``) so the handler's lock is not held meanwhile:
    the engine thread logs its first drop through this handler too."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def handle(self, record: logging.LogRecord) -> bool:
        if record.threadName == "kvserve-kv-events":
            self.entered.set()
            self.release.wait(RECV_TIMEOUT_MS / 1000)
        return True


def test_batches_dropped_while_the_publisher_lags_are_counted_and_exported(ctx) -> None:  # type: ignore[no-untyped-def]
    sub = Subscriber(ctx)
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(
        sub.endpoint,
        block_size=BLOCK,
        medium="CPU",
        replay_endpoint=replay_endpoint,
        queue_batches=1,  # a queue of a batch or two instead of 10,000
    )
    metrics = EngineMetrics("m")
    metrics.track_kv_events(pub)
    logger = logging.getLogger("kvserve.engine.kv_events")
    stall = StallPublisherThread()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        while not sub.recv(timeout_ms=50):  # join: probes until one arrives live
            pub.publish([AllBlocksCleared()])
        start = pub.next_seq
        assert b'kvserve_kv_events_dropped_batches_total{model="m"} 0.0' in metrics.render()[0]

        # A malformed replay request makes the publisher's thread log a warning; the
        # handler holds it there while the engine thread publishes 20 batches.
        logger.addHandler(stall)
        dealer.connect(replay_endpoint)
        dealer.send(b"not a replay request")
        assert stall.entered.wait(RECV_TIMEOUT_MS / 1000), "the publisher thread did not log"
        for _ in range(20):
            pub.publish([AllBlocksCleared()])
        assert pub.next_seq == start + 20
        dropped = pub.dropped_batches
        assert 0 < dropped < 20
    finally:
        stall.release.set()
        logger.removeHandler(stall)
        dealer.close()

    try:
        exported = f'kvserve_kv_events_dropped_batches_total{{model="m"}} {float(dropped)}'
        assert exported.encode() in metrics.render()[0]
        # The batches that were queued arrive once the thread is back, and the dropped
        # ones' sequence numbers are gaps a subscriber can see.
        sent = 20 - dropped
        while len([seq for _, seq, _ in sub.received if seq >= start]) < sent:
            assert sub.recv(RECV_TIMEOUT_MS), "a queued batch did not arrive"
        seqs = [seq for _, seq, _ in sub.received if seq >= start]
        assert seqs == sorted(set(seqs)) and seqs[-1] < start + 20 and len(seqs) == sent
    finally:
        pub.close()


def test_a_replay_of_thousands_of_batches_reaches_a_slow_reader_whole(ctx) -> None:  # type: ignore[no-untyped-def]
    """The replay socket queued past ZMQ's default high-water mark (1,000 messages) and
    silently dropped the rest, the end marker too: a late joiner to a busy replica got
    half its replay and then waited for an end that never came."""
    sub = Subscriber(ctx)
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(
        sub.endpoint, block_size=BLOCK, medium="CPU", replay_endpoint=replay_endpoint
    )
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 1)  # a reader that takes one message at a time
    try:
        while not sub.recv(timeout_ms=50):  # join: probes until one arrives live
            pub.publish([AllBlocksCleared()])
        # 5,000 batches of 4 kB each (a step that stores 64 blocks of 16 tokens): more
        # than the sockets' kernel buffers hold, so ZMQ's own queue decides.
        stored = BlockStored([b"h" * 32] * 64, None, list(range(1024)), 16, None, "CPU", None)
        for _ in range(5000):
            pub.publish([stored])
        sub.until(pub)  # all sent, so all in the replay buffer
        dealer.connect(replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while True:
            assert dealer.poll(RECV_TIMEOUT_MS), f"the replay stopped after {len(seqs)}"
            _, seq, _ = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs == list(range(pub.next_seq))
    finally:
        dealer.close()
        sub.sub.close()
        pub.close()


def test_a_flood_of_replay_requests_does_not_hold_back_live_batches(ctx) -> None:  # type: ignore[no-untyped-def]
    """The publisher's thread answered every waiting replay request before it sent the
    live batches queued meanwhile: a client that kept asking for the whole buffer held
    back every subscriber's live stream (the review's flood: 86 s late). Now it answers
    one replay a turn, after the live batches; so among a burst of requests sent before
    a batch was published, the later ones are answered with that batch in the buffer."""
    sub = Subscriber(ctx)
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(
        sub.endpoint, block_size=BLOCK, medium="CPU", replay_endpoint=replay_endpoint
    )
    flood, witness = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        while not sub.recv(timeout_ms=50):  # join: probes until one arrives live
            pub.publish([AllBlocksCleared()])
        for _ in range(2000):
            pub.publish([AllBlocksCleared()])
        sub.until(pub)  # all sent, so all in the replay buffer
        live = pub.next_seq  # the batch published below
        for s in (flood, witness):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(replay_endpoint)
        # Costly requests (the whole buffer, never read) and cheap ones (from the live
        # batch on), fair-queued by the replay socket.
        for _ in range(500):
            flood.send_multipart((b"", (0).to_bytes(8, "big")))
        for _ in range(500):
            witness.send_multipart((b"", live.to_bytes(8, "big")))
        answers, seen_live = 0, False
        while answers < 500 and not seen_live:
            assert witness.poll(RECV_TIMEOUT_MS), f"replay answers stopped after {answers}"
            _, seq, _ = witness.recv_multipart()
            if seq == END_SEQ:
                answers += 1
                if answers == 1:  # the thread answers the burst now: publish meanwhile
                    pub.publish([AllBlocksCleared()])
            else:
                seen_live = int.from_bytes(seq, "big") == live
        assert seen_live, "every replay request was answered before the live batch went out"
        sub.until(pub)
    finally:
        flood.close()
        witness.close()
        sub.sub.close()
        pub.close()


def test_ipv6_endpoints_bind(ctx) -> None:  # type: ignore[no-untyped-def]
    """``tcp://[::1]:PORT`` and ``tcp://[::]:PORT`` bind (ZMQ sockets are IPv4-only
    unless told otherwise: they failed with "No such device")."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    pub = KVEventPublisher(
        f"tcp://[::]:{free_port()}",
        block_size=BLOCK,
        medium="CPU",
        replay_endpoint=f"tcp://[::1]:{free_port()}",
    )
    pub.close()


def test_bad_endpoints_are_refused_by_name(ctx) -> None:  # type: ignore[no-untyped-def]
    from kvserve.engine.block_pool import BlockPool

    taken = ctx.socket(zmq.ROUTER)
    taken.setsockopt(zmq.LINGER, 0)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ValueError, match="kv_events_replay_endpoint="):
            start_kv_events(
                "tcp://127.0.0.1:1",  # connected: fine, nobody need listen yet
                f"tcp://127.0.0.1:{port}",
                None,
                pool=BlockPool(1),
                block_size=BLOCK,
                device_type="cpu",
            )
    finally:
        taken.close()
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        start_kv_events(
            None, "tcp://127.0.0.1:1", None, pool=BlockPool(1), block_size=1, device_type="cpu"
        )


def test_off_hooks_nothing(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(checkpoint_dir("llama")), dtype="float32", device="cpu")
    assert llm.engine.kv_events is None and llm.engine.kv.pool.events is None


@pytest.mark.slow  # a fresh interpreter that loads torch: ~10 s
def test_off_loads_no_zmq_and_starts_no_thread(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    model = str(checkpoint_dir("llama"))
    code = (
        "from kvserve import LLM, SamplingParams\n"
        f"llm = LLM({model!r}, dtype='float32', device='cpu')\n"
        "llm.generate([list(range(10, 60))], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "assert llm.engine.kv_events is None and llm.engine.kv.pool.events is None\n"
        "import threading\n"
        "assert not [t for t in threading.enumerate() if 'kv-events' in t.name]\n"
    )
    assert heavy_modules_after(code, {"zmq"}) == set()


@pytest.mark.slow
def test_kvserve_serve_publishes_events(checkpoint_dir, ctx) -> None:  # type: ignore[no-untyped-def]
    sub = Subscriber(ctx)
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc, url, _ = start_cli_server(
        checkpoint_dir("llama"),
        "--kv-events-endpoint",
        sub.endpoint,
        "--kv-events-replay-endpoint",
        replay_endpoint,
        "--block-size",
        str(BLOCK),
    )
    try:
        # Join: completions of new prompts until one's BlockStored arrives live.
        stored: list[VllmBlockStored] = []
        prompts: list[list[int]] = []

        def a_block_stored_arrives() -> bool:
            prompt = [200 + len(prompts), *range(10, 10 + 2 * BLOCK)]
            prompts.append(prompt)
            body = {"model": "m", "prompt": prompt, "max_tokens": 1}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
            while sub.recv(timeout_ms=50):
                batch = sub.received[-1][2]
                stored.extend(e for e in batch.events if isinstance(e, VllmBlockStored))
            return bool(stored)

        wait_until(a_block_stored_arrives, timeout=60)
        event = stored[-1]
        assert event.block_size == BLOCK and event.medium == "CPU"
        assert event.token_ids in [p[: 2 * BLOCK] for p in prompts]
        assert len(event.block_hashes) == 2 and event.parent_block_hash is None
        seqs = replay(ctx, replay_endpoint, 0)
        assert seqs == list(range(len(seqs))) and seqs[-1] >= sub.received[-1][1]
        # On /metrics, with nothing dropped.
        exposition = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'kvserve_kv_events_dropped_batches_total{model="m"} 0.0' in exposition
    finally:
        proc.stop()
