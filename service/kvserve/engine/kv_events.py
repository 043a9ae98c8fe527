"""KV-cache events: the prefix cache's changes, published in vLLM's wire format.

A precise-prefix router (llm-d's precise-prefix-cache scorer, NVIDIA Dynamo's KV router)
subscribes to every replica's events and so knows which replica holds which prompt
prefix. The engine records three events (``docs/engine.md``, "KV-cache events"):

- ``BlockStored``: full blocks entered the prefix cache (``BlockPool.cache_full_blocks``);
- ``BlockRemoved``: cached blocks were evicted to be reused (``BlockPool.allocate``);
- ``AllBlocksCleared``: the prefix cache was reset (``BlockPool.reset_prefix_cache``).

The consumer's view (stored minus removed, since the last clear) is exactly the set of
hashes the pool's prefix cache holds (``tests/engine/test_kv_events.py`` checks this).

**Wire format.** vLLM's ``vllm/distributed/kv_events.py``, field for field, encoded as
vLLM encoded it until vllm-project/vllm#42892 (msgspec structs with ``array_like=True``,
``omit_defaults=True``, the event structs ``tag=True``). The field lists are those of
the vLLM file at commit 0181ea31, with its trailing optional fields left out:

- a message is three ZMQ frames: the topic, the sequence number (8 bytes, big-endian)
  and the msgpack payload;
- the payload is ``[ts, events, data_parallel_rank]`` (``ts``: ``time.time()``; the rank
  is always 0: one engine per replica);
- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name]``; ``["BlockRemoved", block_hashes, medium]``;
  ``["AllBlocksCleared"]``.

Block hashes are kvserve's own (``kv_cache_manager.hash_block``: 32-byte SHA-256 digests
that chain the parent, the tokens, the cache salt and the adapter), sent as msgpack
``bin``: vLLM's ``ExternalBlockHash`` is ``bytes | int``, and its own SHA-256 hashes go
out as bytes too. ``lora_id`` is always None (kvserve names adapters, it does not number
them); ``lora_name`` is the request's adapter name. ``medium`` is ``"GPU"`` when the KV
cache lives in CUDA memory and ``"CPU"`` when the engine runs on the CPU (the cache is in
host memory, and that is its only tier).

Newer vLLM releases (after #42892) send the events as msgspec *maps* (``{"type":
"BlockStored", "block_hashes": ...}``) inside the same array-shaped batch; llm-d's
decoder reads both shapes; consumers written for the older releases read only the arrays
sent here.

**Transport.** As vLLM: ``endpoint`` is a ZMQ PUB socket, bound when the address has a
``*`` or ``::`` or is ``ipc://``/``inproc://``, otherwise connected (to a subscriber that
binds); the optional ``replay_endpoint`` is a ROUTER socket (always bound). Both take
IPv6 addresses (``tcp://[::1]:P``), and ``tcp://*:P`` listens on IPv6 as well as IPv4. A subscriber
that joined late, or saw a gap in the sequence numbers, sends ``[b"", start_seq]``
(8 bytes, big-endian) to it; the publisher answers every buffered batch with
``seq >= start_seq`` as ``[b"", seq, payload]`` and then ``[b"", -1 (8 bytes, signed),
b""]``, all queued at once for that client (up to the whole buffer: a slow reader misses
none of it).

**Cost.** Off (no endpoint), the engine holds no recorder: the block pool's hooks are one
``is None`` check where a block is cached (per registration, not per block), evicted or
the cache reset, and nothing of this module but its types is loaded (no ZMQ). On, the
engine thread builds the events, encodes each step's batch (one msgspec call) and hands
it to the publisher thread through a bounded in-process ZMQ queue without ever blocking:
when the queue is full the batch is dropped and counted (``dropped_batches``; on
``/metrics`` as ``kvserve_kv_events_dropped_batches_total``), which leaves a gap in the
sequence numbers that the subscriber can see. The publisher thread
sends, keeps the replay buffer and answers replay requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import zmq

    from kvserve.engine.block_pool import BlockPool
    from kvserve.engine.request import Request

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message
REPLAY_BATCHES = 10_000  # batches kept for replay (vLLM's buffer_steps)
QUEUE_BATCHES = 10_000  # batches that may wait for the publisher thread
PUB_HWM = 100_000  # messages the PUB socket queues per subscriber (vLLM's hwm)
CLOSE_LINGER_MS = 500  # on close, how long the PUB socket may take to flush


class KVCacheEvent(
    msgspec.Struct,
    array_like=True,
    omit_defaults=True,
    gc=False,  # no reference cycles: the collector need not track them
    tag=True,  # the class name is the array's first element
):
    """One change of the prefix cache."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # None: the first block is the prompt's first
    token_ids: list[int]  # block_size tokens per hash, in order
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events (the payload of one message)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVEventRecorder:
    """Collects the block pool's events in order, on the engine thread."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium
        self.events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def stored(self, hashes: Sequence[bytes], indices: Sequence[int], request: Request) -> None:
        """Blocks ``indices`` (ascending) of ``request`` entered the cache: one BlockStored
        per contiguous run, whose parent is the block before the run."""
        bs = self.block_size
        tokens = request.all_token_ids
        lora_name = request.lora.lora_name if request.lora is not None else None
        first = prev = indices[0]
        for i in [*indices[1:], -1]:
            if i == prev + 1:
                prev = i
                continue
            self.events.append(
                BlockStored(
                    list(hashes[first : prev + 1]),
                    hashes[first - 1] if first > 0 else None,
                    tokens[first * bs : (prev + 1) * bs],
                    bs,
                    None,
                    self.medium,
                    lora_name,
                )
            )
            first = prev = i

    def removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):  # consecutive evictions: one event
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], self.medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        events, self.events = self.events, []
        return events


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address, ipc:// or inproc:// is bound, else connected."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class KVEventPublisher:
    """The engine's KV-cache events: its recorder, and the ZMQ sockets on their own thread.

    ``end_step()`` (engine thread) publishes what the recorder holds as one batch;
    ``close()`` sends what is queued and stops the thread. Sockets are opened in the
    constructor, so a bad or busy endpoint is a ValueError when the engine starts.
    """

    _instances = itertools.count()

    def __init__(
        self,
        endpoint: str,
        *,
        block_size: int,
        medium: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_batches: int = REPLAY_BATCHES,
        queue_batches: int = QUEUE_BATCHES,
    ) -> None:
        import zmq

        self.recorder = KVEventRecorder(block_size, medium)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.next_seq = 0  # the sequence number of the next batch
        self.dropped_batches = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        self._ctx = zmq.Context()
        queue_address = f"inproc://kvserve-kv-events-{next(self._instances)}"
        sockets: list[zmq.Socket[bytes]] = []
        try:
            self._pull = self._socket(zmq.PULL, sockets, rcvhwm=queue_batches)
            self._pull.bind(queue_address)
            self._push = self._socket(zmq.PUSH, sockets, sndhwm=queue_batches)
            self._push.connect(queue_address)
            self._pub = self._socket(zmq.PUB, sockets, sndhwm=PUB_HWM, ipv6=1)
            _open(self._pub, endpoint, "kv_events_endpoint", bind=binds(endpoint))
            self._replay: zmq.Socket[bytes] | None = None
            if replay_endpoint is not None:
                # A whole replay (and its end marker) fits in a client's queue: ROUTER
                # drops, rather than blocks on, what goes past its high-water mark.
                self._replay = self._socket(zmq.ROUTER, sockets, sndhwm=replay_batches + 1, ipv6=1)
                _open(self._replay, replay_endpoint, "kv_events_replay_endpoint", bind=True)
        except BaseException:
            for s in sockets:
                s.close(linger=0)
            self._ctx.term()
            raise
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        """The publisher thread's native id (the benchmark reads its CPU time)."""
        return self._thread.native_id

    def _socket(
        self, kind: int, opened: list[zmq.Socket[bytes]], **options: int
    ) -> zmq.Socket[bytes]:
        import zmq

        s: zmq.Socket[bytes] = self._ctx.socket(kind)
        opened.append(s)
        s.setsockopt(zmq.LINGER, 0)  # never hold the process at exit for a subscriber
        for name, value in options.items():
            s.setsockopt(getattr(zmq, name.upper()), value)
        return s

    # ---- the engine thread ---------------------------------------------------------------
    def end_step(self) -> None:
        """Publish the step's events, if any, as one batch; never blocks."""
        if self.recorder.events:
            self.publish(self.recorder.take())

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        import zmq

        payload = self._encoder.encode(EventBatch(time.time(), events, 0))
        seq = self.next_seq
        self.next_seq += 1
        try:
            self._push.send_multipart((seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            # The publisher thread is behind (starved of CPU): dropping keeps the engine
            # stepping, and the skipped sequence number tells subscribers they missed it.
            self.dropped_batches += 1
            if self.dropped_batches == 1 or self.dropped_batches % 1000 == 0:
                log.warning("KV-cache events: %d batches dropped so far", self.dropped_batches)

    def close(self) -> None:
        """Send what is queued, stop the thread and close the sockets (from the thread
        that steps the engine, or once it has stopped)."""
        import zmq

        if not self._thread.is_alive():
            return
        self._push.setsockopt(zmq.SNDTIMEO, 5000)
        try:
            self._push.send(b"")  # the stop signal, after every queued batch
        except zmq.Again:
            log.warning("KV-cache events: the publisher thread did not take the stop signal")
            return
        self._thread.join(timeout=10)
        self._push.close(linger=0)
        if not self._thread.is_alive():
            self._ctx.term()

    # ---- the publisher thread ------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                # Live batches first, then one replay a turn: a client that sends replay
                # requests faster than they are answered delays the live stream by one
                # replay at most, not by all of its requests.
                if self._pull in ready and not self._send_queued():
                    return
                if self._replay is not None and self._replay in ready:
                    self._serve_replay(self._replay)
        except Exception:
            log.exception("KV-cache events: the publisher thread failed; no more events")
        finally:
            self._pull.close(linger=0)
            self._pub.close(linger=CLOSE_LINGER_MS)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send_queued(self) -> bool:
        """Send every queued batch; False once the stop signal came."""
        import zmq

        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if len(frames) == 1:  # close()'s stop signal
                return False
            seq_bytes, payload = frames
            # PUB never blocks: a subscriber past its high-water mark misses messages.
            self._pub.send_multipart((self.topic, seq_bytes, payload))
            self._buffer.append((int.from_bytes(seq_bytes, "big"), payload))

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        """Answer the next replay request, if one is waiting."""
        import zmq

        try:
            frames = replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("KV-cache events: ignored a malformed replay request")
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        # Queued whole (the socket's high-water mark is the buffer's size); a client
        # that asks again without reading gets what still fits.
        for seq, payload in self._buffer:
            if seq >= start_seq:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))


def _open(socket: zmq.Socket[bytes], endpoint: str, name: str, *, bind: bool) -> None:
    import zmq

    try:
        if bind:
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as exc:
        raise ValueError(
            f"{name}={endpoint!r}: cannot {'bind' if bind else 'connect'}: {exc}"
        ) from None


def start_kv_events(
    endpoint: str | None,
    replay_endpoint: str | None,
    topic: str | None,
    *,
    pool: BlockPool,
    block_size: int,
    device_type: str,
) -> KVEventPublisher | None:
    """The engine's publisher, hooked into its block pool; None (and no hook) when off."""
    if endpoint is None:
        if replay_endpoint is not None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        return None
    publisher = KVEventPublisher(
        endpoint,
        block_size=block_size,
        medium=MEDIUM_GPU if device_type == "cuda" else MEDIUM_CPU,
        replay_endpoint=replay_endpoint,
        topic=topic or "",
    )
    pool.events = publisher.recorder
    return publisher
