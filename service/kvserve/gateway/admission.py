"""Admission and backpressure: at most ``capacity`` requests in flight per replica.

Why: an engine that accepts more than it can batch only grows its own queue; every
admitted request then gets slower. The gateway instead keeps a slot count per replica
(``slots.ReplicaSlots``) and, when no eligible replica has a free slot, parks the request
in a small bounded queue (:class:`AdmissionQueue`). Offered load above capacity turns
into fast, cheap rejections (HTTP 503 + ``Retry-After``) while admitted requests keep
their latency.

Design, on one asyncio event loop (no locks: every state change is a plain method call
between two awaits):

- ``acquire(tenant, priority, pick, pool=...)``: ``pick()`` is the caller's routing +
  capacity check; it returns an address with a free slot or ``None``. ``pool`` names the
  replicas it picks from (the gateway's: the model). With nobody of its pool queued and
  an address, the slot is taken at once. Otherwise the request waits on a future.
- Order: priority first (``critical`` > ``standard`` > ``sheddable``); within a
  priority, tenants take turns (round robin, one request each), so a tenant with 100
  queued requests delays another tenant's single request by at most one admission;
  FIFO within a tenant.
- Head of line, per pool: a waiter whose ``pick()`` finds no slot blocks the later
  waiters of its pool (letting them overtake would only starve it: they pick from the
  same replicas), and admission goes on with the waiters of other pools, whose replicas
  may have free slots: a request for an idle model never waits behind a busy one's.
- Full queue: the request fails at once (``QueueFull``, reason ``full``), unless a
  higher-priority request can evict the newest waiter of a lower priority (lowest
  first); the evicted one fails with ``QueueFull`` (reason ``shed``). So ``critical``
  is never shed while ``sheddable`` waits, and ``sheddable`` never sheds anyone.
- Timeout: each waiter has a timer; when it fires first, the waiter leaves the queue
  with ``QueueTimeout``. Grant and expiry both run on the loop, so exactly one wins.
- Cancellation (client gone while queued): the waiter leaves the queue; if it was
  granted a slot in the same loop turn it was cancelled, the slot goes back.
- ``release(slot)`` frees the slot exactly once (idempotent) and admits waiters that
  now fit; ``notify()`` does the same after capacity changed (replica added, load
  update).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from kvserve.gateway.slots import ReplicaSlots

Priority = Literal["critical", "standard", "sheddable"]
PRIORITIES: tuple[Priority, ...] = ("critical", "standard", "sheddable")  # highest first
_RANK: dict[Priority, int] = {priority: rank for rank, priority in enumerate(PRIORITIES)}


@dataclass(eq=False)
class Slot:
    """An admitted request's hold on one replica; give it back with ``release``."""

    address: str
    wait_seconds: float
    released: bool = field(default=False, repr=False)


class AdmissionRejected(Exception):
    """Not admitted; the HTTP layer answers 503 with ``Retry-After: retry_after``."""

    def __init__(
        self, message: str, *, reason: Literal["full", "shed", "timeout"], retry_after: int
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class QueueFull(AdmissionRejected):
    """The queue was full (reason ``full``) or this waiter was evicted by a higher
    priority request (reason ``shed``)."""


class QueueTimeout(AdmissionRejected):
    """Waited ``timeout`` seconds without a slot coming free."""


@dataclass(eq=False)
class _Waiter:
    tenant: str
    priority: Priority
    pick: Callable[[], str | None]
    future: asyncio.Future[Slot]
    enqueued_at: float
    seq: int
    pool: Hashable = None
    timer: asyncio.TimerHandle | None = None


class _Lane:
    """One priority's waiters: a FIFO per tenant, tenants served in rotation."""

    def __init__(self) -> None:
        self.by_tenant: dict[str, deque[_Waiter]] = {}
        self.rotation: deque[str] = deque()  # tenants with waiters, next to serve first
        self.size = 0

    def push(self, waiter: _Waiter) -> None:
        queue = self.by_tenant.get(waiter.tenant)
        if queue is None:
            queue = self.by_tenant[waiter.tenant] = deque()
            self.rotation.append(waiter.tenant)  # a newly active tenant goes last
        queue.append(waiter)
        self.size += 1

    def in_order(self) -> Iterator[_Waiter]:
        """The waiters in the order they would be served if each were admitted in turn:
        the rotation's tenants one request each, round after round."""
        queues = [self.by_tenant[tenant] for tenant in self.rotation]
        for round_ in range(max(map(len, queues), default=0)):
            yield from (queue[round_] for queue in queues if round_ < len(queue))

    def take(self, waiter: _Waiter) -> None:
        """Take an admitted waiter out and move its tenant to the back of the rotation."""
        queue = self.by_tenant[waiter.tenant]
        queue.remove(waiter)
        self.rotation.remove(waiter.tenant)
        if queue:
            self.rotation.append(waiter.tenant)
        else:
            del self.by_tenant[waiter.tenant]
        self.size -= 1

    def remove(self, waiter: _Waiter) -> bool:
        """Take a waiter out of the middle (timeout, cancel, shed); False if not here."""
        queue = self.by_tenant.get(waiter.tenant)
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del self.by_tenant[waiter.tenant]
            self.rotation.remove(waiter.tenant)
        self.size -= 1
        return True

    def newest(self) -> _Waiter | None:
        """The most recently queued waiter (each tenant's newest is its last)."""
        lasts = [queue[-1] for queue in self.by_tenant.values()]
        return max(lasts, key=lambda waiter: waiter.seq) if lasts else None


class AdmissionQueue:
    """Bounded, priority- and tenant-fair wait for a replica slot (see module docstring).

    ``max_size`` bounds the waiters (0: never queue), ``timeout`` is the longest wait in
    seconds, ``on_wait(seconds)`` is called with the wait of every admitted request (0.0
    for those admitted at once, so the histogram's count is all admissions).
    ``retry_after`` (seconds, default ``ceil(timeout)``, at least 1) is what rejections
    tell clients: by then every request queued now has been admitted or timed out.
    """

    def __init__(
        self,
        max_size: int,
        timeout: float,
        on_wait: Callable[[float], None] | None = None,
        *,
        slots: ReplicaSlots | None = None,
        retry_after: int | None = None,
    ) -> None:
        if max_size < 0:
            raise ValueError(f"max_size must be ≥ 0, got {max_size}")
        if not timeout >= 0:
            raise ValueError(f"timeout must be ≥ 0 seconds, got {timeout}")
        self.max_size = max_size
        self.timeout = timeout
        self.on_wait = on_wait
        self.slots = slots if slots is not None else ReplicaSlots()
        self.retry_after = retry_after if retry_after is not None else max(1, math.ceil(timeout))
        self._lanes: dict[Priority, _Lane] = {priority: _Lane() for priority in PRIORITIES}
        self._queued_by_pool: Counter[Hashable] = Counter()
        self._seq = itertools.count()
        self._admitting = False
        self._admit_again = False

    @property
    def queue_length(self) -> int:
        return sum(lane.size for lane in self._lanes.values())

    @property
    def queue_length_by_priority(self) -> dict[Priority, int]:
        return {priority: lane.size for priority, lane in self._lanes.items()}

    async def acquire(
        self,
        tenant: str,
        priority: Priority,
        pick: Callable[[], str | None],
        *,
        pool: Hashable = None,
        held: float = 0.0,
    ) -> Slot:
        """A slot on the replica ``pick()`` chose, waiting in the queue if none is free.

        ``pool``: what ``pick()`` picks from (waiters of one pool keep their order; see
        the module docstring). ``held``: seconds the request already waited before the
        queue for its model's first replica (scale from zero); they count in its reported
        wait.
        Raises ``QueueFull`` (at once, or later if shed) or ``QueueTimeout``.
        """
        if priority not in _RANK:
            raise ValueError(f"unknown priority {priority!r}; allowed: {', '.join(PRIORITIES)}")
        loop = asyncio.get_running_loop()
        if self._queued_by_pool[pool] == 0:
            address = pick()
            if address is not None:
                return self._grant_now(address, held)
        if self.queue_length >= self.max_size and not self._shed_for(priority):
            raise QueueFull(
                f"admission queue full ({self.max_size} waiting)",
                reason="full",
                retry_after=self.retry_after,
            )
        waiter = _Waiter(
            tenant, priority, pick, loop.create_future(), loop.time() - held, next(self._seq), pool
        )
        waiter.timer = loop.call_later(self.timeout, self._expire, waiter)
        self._lanes[priority].push(waiter)
        self._queued_by_pool[pool] += 1
        self._admit()  # capacity may exist for waiters ahead of us, or for us
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def release(self, slot: Slot) -> None:
        """Give the slot back (only the first call counts) and admit waiters that fit."""
        if slot.released:
            return
        slot.released = True
        self.slots.give(slot.address)
        self._admit()

    def notify(self) -> None:
        """Capacity changed (replica added, load updated): admit waiters that now fit."""
        self._admit()

    def _grant_now(self, address: str, held: float = 0.0) -> Slot:
        self.slots.take(address)
        if self.on_wait is not None:
            self.on_wait(held)
        return Slot(address, held)

    def _shed_for(self, priority: Priority) -> bool:
        """Evict the newest waiter of the lowest priority below ``priority``, if any."""
        for lower in reversed(PRIORITIES):
            if _RANK[lower] <= _RANK[priority]:
                return False
            victim = self._lanes[lower].newest()
            if victim is not None:
                self._drop(victim)
                if victim.future.done():  # cancelled, not yet cleaned up: gone anyway
                    return True
                victim.future.set_exception(
                    QueueFull(
                        f"shed from the admission queue for a {priority} request",
                        reason="shed",
                        retry_after=self.retry_after,
                    )
                )
                return True
        return False

    def _drop(self, waiter: _Waiter) -> bool:
        if waiter.timer is not None:
            waiter.timer.cancel()
        removed = self._lanes[waiter.priority].remove(waiter)
        if removed:
            self._left(waiter)
        return removed

    def _left(self, waiter: _Waiter) -> None:
        self._queued_by_pool[waiter.pool] -= 1
        if not self._queued_by_pool[waiter.pool]:
            del self._queued_by_pool[waiter.pool]

    def _expire(self, waiter: _Waiter) -> None:
        if self._drop(waiter) and not waiter.future.done():
            waited = waiter.future.get_loop().time() - waiter.enqueued_at
            waiter.future.set_exception(
                QueueTimeout(
                    f"no replica slot came free within {waited:.3f} s",
                    reason="timeout",
                    retry_after=self.retry_after,
                )
            )

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiting task was cancelled: leave the queue and hold nothing."""
        self._drop(waiter)
        future = waiter.future
        if future.done() and not future.cancelled():
            if future.exception() is None:
                # Granted in the same loop turn as the cancel: the slot is ours to return.
                self.release(future.result())
        else:
            future.cancel()

    def _admit(self) -> None:
        """Grant slots to waiters in order until the head finds none (see module doc)."""
        if self._admitting:  # re-entered from a pick()/on_wait(): the outer loop reruns
            self._admit_again = True
            return
        self._admitting = True
        try:
            self._admit_again = True
            while self._admit_again:
                self._admit_again = False
                self._admit_in_order()
        finally:
            self._admitting = False

    def _take(self, waiter: _Waiter) -> None:
        """Dequeue an admitted (or failed) waiter; its tenant goes to the back of the
        rotation."""
        if waiter.timer is not None:
            waiter.timer.cancel()
        self._lanes[waiter.priority].take(waiter)
        self._left(waiter)

    def _in_order(self) -> Iterator[_Waiter]:
        for priority in PRIORITIES:
            yield from self._lanes[priority].in_order()

    def _admit_in_order(self) -> None:
        """Grant slots in order; a waiter that finds none blocks its pool for the rest of
        this pass (no slot frees during it)."""
        blocked: set[Hashable] = set()
        while True:
            for waiter in self._in_order():
                if waiter.pool in blocked:
                    continue
                if waiter.future.done():  # cancelled; its task has not run its cleanup yet
                    self._take(waiter)
                    break  # the order changed: start over
                try:
                    address = waiter.pick()
                except Exception as exc:  # a broken pick fails its own request, not the queue
                    self._take(waiter)
                    waiter.future.set_exception(exc)
                    break
                if address is None:
                    blocked.add(waiter.pool)
                    continue
                self._take(waiter)
                self.slots.take(address)
                waited = waiter.future.get_loop().time() - waiter.enqueued_at
                waiter.future.set_result(Slot(address, waited))
                if self.on_wait is not None:
                    self.on_wait(waited)
                break
            else:
                return
