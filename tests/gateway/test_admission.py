"""Admission queue: slots per replica, priority and tenant order, shedding, timeouts,
cancellation. Each test runs its own event loop (``asyncio.run``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.gateway.admission import (
    AdmissionQueue,
    Priority,
    QueueFull,
    QueueTimeout,
    Slot,
)
from kvserve.gateway.routing import LeastLoadRouter, ReplicaLoad
from kvserve.gateway.slots import ReplicaSlots

DEADLINE = 5.0  # seconds; only reached when something is broken


class Fleet:
    """Replicas with a capacity each; ``pick`` routes to one with a free slot (least load)."""

    def __init__(self, queue: AdmissionQueue, capacity: dict[str, int]) -> None:
        self.queue = queue
        self.capacity = capacity
        self.router = LeastLoadRouter()

    def loads(self) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(address, self.queue.slots.in_flight(address), 0, 0, capacity)
            for address, capacity in self.capacity.items()
        ]

    def pick(self) -> str | None:
        decision = self.router.route("", self.loads())
        return decision.address if decision else None


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


async def settle() -> None:
    """Let every ready task run until it blocks again (event-loop turns, not a timed wait)."""
    for _ in range(5):
        await asyncio.sleep(0)


def start(
    queue: AdmissionQueue,
    fleet: Fleet,
    tenant: str,
    priority: Priority = "standard",
    pool: str | None = None,
) -> asyncio.Task[Slot]:
    return asyncio.create_task(queue.acquire(tenant, priority, fleet.pick, pool=pool))


async def admission_order(
    queue: AdmissionQueue, held: Slot, tasks: dict[str, asyncio.Task[Slot]]
) -> list[str]:
    """Release one slot at a time (capacity 1) and record which waiter gets it."""
    order: list[str] = []
    pending = dict(tasks)
    while pending:
        queue.release(held)
        done, _ = await asyncio.wait(
            pending.values(), timeout=DEADLINE, return_when=asyncio.FIRST_COMPLETED
        )
        assert len(done) == 1, "exactly one waiter is admitted per freed slot"
        task = done.pop()
        label = next(label for label, t in pending.items() if t is task)
        order.append(label)
        del pending[label]
        held = task.result()
    queue.release(held)
    return order


async def expect(awaitable: Awaitable[Slot], error: type[BaseException]) -> BaseException:
    with pytest.raises(error) as info:
        await asyncio.wait_for(awaitable, DEADLINE)
    return info.value


def test_free_slot_is_taken_at_once_and_released_once() -> None:
    async def main() -> None:
        waits: list[float] = []
        queue = AdmissionQueue(max_size=4, timeout=1.0, on_wait=waits.append)
        fleet = Fleet(queue, {"a:1": 1, "b:1": 1})
        first = await queue.acquire("t", "standard", fleet.pick)
        second = await queue.acquire("t", "standard", fleet.pick)
        assert {first.address, second.address} == {"a:1", "b:1"}
        assert first.wait_seconds == 0.0 and waits == [0.0, 0.0]
        assert queue.slots.snapshot() == {"a:1": 1, "b:1": 1}
        queue.release(first)
        queue.release(first)  # idempotent: the second call frees nothing
        assert queue.slots.snapshot() == {second.address: 1}
        queue.release(second)
        assert queue.slots.total == 0 and queue.queue_length == 0

    run(main)


def test_waiters_are_admitted_by_priority() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=10, timeout=DEADLINE)
        fleet = Fleet(queue, {"a:1": 1})
        held = await queue.acquire("t", "standard", fleet.pick)
        tasks = {
            "sheddable": start(queue, fleet, "t", "sheddable"),
            "standard": start(queue, fleet, "t", "standard"),
            "critical": start(queue, fleet, "t", "critical"),
        }
        await settle()
        assert queue.queue_length == 3
        assert queue.queue_length_by_priority == {"critical": 1, "standard": 1, "sheddable": 1}
        assert await admission_order(queue, held, tasks) == ["critical", "standard", "sheddable"]
        assert queue.slots.total == 0 and queue.queue_length == 0

    run(main)


def test_tenants_take_turns_and_each_tenant_is_fifo() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=20, timeout=DEADLINE)
        fleet = Fleet(queue, {"a:1": 1})
        held = await queue.acquire("x", "standard", fleet.pick)
        tasks: dict[str, asyncio.Task[Slot]] = {}
        for label in ["A0", "A1", "A2", "A3", "A4", "B0", "B1", "C0"]:
            tasks[label] = start(queue, fleet, label[0])
            await settle()  # queue in exactly this order
        order = await admission_order(queue, held, tasks)
        # A's five queued first, yet B and C wait at most one A request each.
        assert order == ["A0", "B0", "C0", "A1", "B1", "A2", "A3", "A4"]

    run(main)


def test_new_request_does_not_overtake_waiters() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=10, timeout=DEADLINE)
        capacity = {"a:1": 1}
        fleet = Fleet(queue, capacity)
        held = await queue.acquire("t", "standard", fleet.pick)
        waiter = start(queue, fleet, "t")
        await settle()
        capacity["a:1"] = 2  # a slot frees up without notify(): a newcomer must still queue
        newcomer = start(queue, fleet, "u")
        await asyncio.wait_for(waiter, DEADLINE)  # the newcomer's enqueue admitted the waiter
        await settle()
        assert not newcomer.done() and queue.queue_length == 1
        queue.release(held)
        admitted = await asyncio.wait_for(newcomer, DEADLINE)
        queue.release(admitted)
        queue.release(waiter.result())
        assert queue.slots.total == 0

    run(main)


def test_a_waiter_never_waits_behind_another_pools_blocked_waiter() -> None:
    """Two models (pools) behind one queue: the busy one's waiters keep their order, and
    the idle one's requests pass them (they pick from other replicas)."""

    async def main() -> None:
        queue = AdmissionQueue(max_size=10, timeout=DEADLINE)
        busy, idle = Fleet(queue, {"a:1": 1}), Fleet(queue, {"b:1": 1})
        held_busy = await queue.acquire("t", "standard", busy.pick, pool="busy")
        blocked = asyncio.create_task(queue.acquire("t", "standard", busy.pick, pool="busy"))
        await settle()
        # Admitted at once although a request of the busy model heads the queue.
        held_idle = await asyncio.wait_for(
            queue.acquire("u", "standard", idle.pick, pool="idle"), DEADLINE
        )
        assert held_idle.address == "b:1" and not blocked.done()
        # Queued behind the blocked waiter, admitted as soon as its own model frees a slot.
        behind = asyncio.create_task(queue.acquire("u", "standard", idle.pick, pool="idle"))
        await settle()
        assert queue.queue_length == 2
        queue.release(held_idle)
        assert (await asyncio.wait_for(behind, DEADLINE)).address == "b:1"
        assert not blocked.done()
        queue.release(held_busy)
        assert (await asyncio.wait_for(blocked, DEADLINE)).address == "a:1"
        queue.release(behind.result())
        queue.release(blocked.result())
        assert queue.slots.total == 0 and queue.queue_length == 0

    run(main)


def test_full_queue_rejects_at_once_with_retry_after() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=2, timeout=2.5)
        fleet = Fleet(queue, {"a:1": 1})
        held = await queue.acquire("t", "standard", fleet.pick)
        waiters = [start(queue, fleet, "t"), start(queue, fleet, "u")]
        await settle()
        error = await expect(queue.acquire("v", "standard", fleet.pick), QueueFull)
        assert isinstance(error, QueueFull)
        assert error.reason == "full" and error.retry_after == 3
        assert queue.queue_length == 2
        assert await admission_order(queue, held, {"t": waiters[0], "u": waiters[1]}) == [
            "t",
            "u",
        ]

    run(main)


def test_zero_size_queue_never_waits() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=0, timeout=DEADLINE)
        fleet = Fleet(queue, {"a:1": 1})
        held = await queue.acquire("t", "critical", fleet.pick)
        await expect(queue.acquire("t", "critical", fleet.pick), QueueFull)
        queue.release(held)

    run(main)


def test_wait_past_timeout_raises_queue_timeout_and_leaves_the_queue() -> None:
    async def main() -> None:
        waits: list[float] = []
        queue = AdmissionQueue(max_size=4, timeout=0.05, on_wait=waits.append)
        fleet = Fleet(queue, {"a:1": 1})
        held = await queue.acquire("t", "standard", fleet.pick)
        error = await expect(queue.acquire("t", "critical", fleet.pick), QueueTimeout)
        assert isinstance(error, QueueTimeout) and error.reason == "timeout"
        assert error.retry_after >= 1
        assert queue.queue_length == 0 and waits == [0.0]  # only the admitted request
        queue.release(held)
        assert queue.slots.total == 0

    run(main)


def test_critical_sheds_the_newest_sheddable_first_never_the_reverse() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=3, timeout=DEADLINE)
        fleet = Fleet(queue, {"a:1": 1})
        held = await queue.acquire("t", "standard", fleet.pick)
        old_sheddable = start(queue, fleet, "t", "sheddable")
        standard = start(queue, fleet, "t", "standard")
        new_sheddable = start(queue, fleet, "u", "sheddable")
        await settle()
        # Full. A sheddable request sheds nobody; it is refused.
        await expect(queue.acquire("t", "sheddable", fleet.pick), QueueFull)
        # A critical request evicts the newest sheddable waiter.
        critical = start(queue, fleet, "t", "critical")
        error = await expect(new_sheddable, QueueFull)
        assert isinstance(error, QueueFull) and error.reason == "shed"
        await settle()
        assert not old_sheddable.done() and not standard.done()
        # Next: the remaining sheddable goes before the (newer) standard one.
        critical2 = start(queue, fleet, "t", "critical")
        await expect(old_sheddable, QueueFull)
        # Only critical and standard left: standard is shed for critical, never critical.
        critical3 = start(queue, fleet, "t", "critical")
        await expect(standard, QueueFull)
        await expect(queue.acquire("t", "critical", fleet.pick), QueueFull)
        await expect(queue.acquire("t", "standard", fleet.pick), QueueFull)
        assert queue.queue_length_by_priority == {"critical": 3, "standard": 0, "sheddable": 0}
        order = await admission_order(
            queue, held, {"c1": critical, "c2": critical2, "c3": critical3}
        )
        assert order == ["c1", "c2", "c3"]
        assert queue.slots.total == 0 and queue.queue_length == 0

    run(main)


def test_standard_sheds_sheddable_but_not_standard() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=2, timeout=DEADLINE)
        fleet = Fleet(queue, {"a:1": 1})
        held = await queue.acquire("t", "standard", fleet.pick)
        standard = start(queue, fleet, "t", "standard")
        sheddable = start(queue, fleet, "t", "sheddable")
        await settle()
        newcomer = start(queue, fleet, "u", "standard")
        await expect(sheddable, QueueFull)
        await expect(queue.acquire("v", "standard", fleet.pick), QueueFull)
        assert await admission_order(queue, held, {"s": standard, "n": newcomer}) == ["s", "n"]

    run(main)


def test_cancelled_waiter_leaves_no_trace() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=4, timeout=DEADLINE)
        fleet = Fleet(queue, {"a:1": 1})
        held = await queue.acquire("t", "standard", fleet.pick)
        waiter = start(queue, fleet, "t")
        await settle()
        assert queue.queue_length == 1
        waiter.cancel()
        await expect(waiter, asyncio.CancelledError)
        assert queue.queue_length == 0
        queue.release(held)
        assert queue.slots.total == 0
        again = await queue.acquire("t", "standard", fleet.pick)  # admitted at once
        assert again.wait_seconds == 0.0
        queue.release(again)

    run(main)


def test_cancel_racing_a_grant_gives_the_slot_back() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=4, timeout=DEADLINE)
        fleet = Fleet(queue, {"a:1": 1})
        held = await queue.acquire("t", "standard", fleet.pick)
        unlucky = start(queue, fleet, "t")
        next_in_line = start(queue, fleet, "u")
        await settle()
        queue.release(held)  # grants `unlucky` the slot (its task has not resumed yet)...
        assert queue.slots.in_flight("a:1") == 1
        unlucky.cancel()  # ...and its client disconnects in the same loop turn
        await expect(unlucky, asyncio.CancelledError)
        # The slot went back and on to the next waiter; nothing leaked.
        slot = await asyncio.wait_for(next_in_line, DEADLINE)
        assert queue.slots.in_flight("a:1") == 1 and queue.queue_length == 0
        queue.release(slot)
        assert queue.slots.total == 0

    run(main)


def test_cancel_while_a_release_is_pending_does_not_grant_the_dead_waiter() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=4, timeout=DEADLINE)
        fleet = Fleet(queue, {"a:1": 1})
        held = await queue.acquire("t", "standard", fleet.pick)
        gone = start(queue, fleet, "t")
        alive = start(queue, fleet, "u")
        await settle()
        gone.cancel()  # cancelled, but its cleanup has not run yet...
        queue.release(held)  # ...when the slot frees: it must go to the live waiter
        slot = await asyncio.wait_for(alive, DEADLINE)
        await expect(gone, asyncio.CancelledError)
        queue.release(slot)
        assert queue.slots.total == 0 and queue.queue_length == 0

    run(main)


def test_notify_admits_waiters_when_capacity_grows() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=4, timeout=DEADLINE)
        capacity: dict[str, int] = {}
        fleet = Fleet(queue, capacity)  # no replicas yet
        waiter = start(queue, fleet, "t")
        await settle()
        assert not waiter.done()
        capacity["new:1"] = 1  # a replica came up
        queue.notify()
        slot = await asyncio.wait_for(waiter, DEADLINE)
        assert slot.address == "new:1"
        queue.release(slot)

    run(main)


def test_a_failing_pick_fails_only_its_request() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_size=4, timeout=DEADLINE)
        fleet = Fleet(queue, {"a:1": 1})
        held = await queue.acquire("t", "standard", fleet.pick)
        broken_after_wait = False

        def broken() -> str | None:
            if broken_after_wait:
                raise RuntimeError("routing blew up")
            return None

        bad = asyncio.create_task(queue.acquire("t", "critical", broken))
        good = start(queue, fleet, "u")
        await settle()
        broken_after_wait = True
        queue.release(held)
        await expect(bad, RuntimeError)
        queue.release(await asyncio.wait_for(good, DEADLINE))
        assert queue.slots.total == 0 and queue.queue_length == 0

    run(main)


def test_replica_slots_refuse_a_give_without_a_take() -> None:
    slots = ReplicaSlots()
    slots.take("a:1")
    slots.give("a:1")
    assert slots.snapshot() == {}
    with pytest.raises(ValueError, match="double release"):
        slots.give("a:1")


class CountingSlots(ReplicaSlots):
    """Real slot accounting, plus a record of every take and give."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = 0
        self.given = 0

    def take(self, address: str) -> None:
        super().take(address)
        self.taken += 1

    def give(self, address: str) -> None:
        super().give(address)
        self.given += 1


OPERATIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("acquire"),
            st.sampled_from(["t1", "t2", "t3"]),
            st.sampled_from(["critical", "standard", "sheddable"]),
            st.sampled_from(["p", "q"]),  # the pool (model), each with replicas of its own
        ),
        st.tuples(st.just("release"), st.integers(0, 20), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 20), st.booleans()),
        st.tuples(
            st.just("grow"), st.sampled_from(["a:1", "b:1", "c:1", "q:1"]), st.integers(1, 2)
        ),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(operations=OPERATIONS, max_size=st.integers(0, 4))
def test_slots_never_exceed_capacity_and_each_is_released_once(
    operations: list[tuple[Any, ...]], max_size: int
) -> None:
    async def main() -> None:
        slots = CountingSlots()
        queue = AdmissionQueue(max_size=max_size, timeout=60.0, slots=slots)
        capacity = {"a:1": 1, "b:1": 0}
        pools = {"p": Fleet(queue, capacity), "q": Fleet(queue, {"q:1": 1})}
        tasks: list[asyncio.Task[Slot]] = []
        released: list[Slot] = []

        def admitted() -> list[Slot]:
            return [
                t.result() for t in tasks if t.done() and not t.cancelled() and not t.exception()
            ]

        def holding() -> list[Slot]:
            return [slot for slot in admitted() if not slot.released]

        def waiting() -> list[asyncio.Task[Slot]]:
            return [t for t in tasks if not t.done()]

        for operation in operations:
            kind = operation[0]
            if kind == "acquire":
                fleet = pools[operation[3]]
                tasks.append(start(queue, fleet, operation[1], operation[2], operation[3]))
            elif kind == "release" and (held := holding()):
                slot = held[operation[1] % len(held)]
                queue.release(slot)
                released.append(slot)
                if operation[2]:
                    queue.release(slot)  # a duplicate release must change nothing
                    # ...and a cancel racing the grant this release just made
                    if pending := waiting():
                        pending[0].cancel()
            elif kind == "cancel" and (pending := waiting()):
                pending[operation[1] % len(pending)].cancel()
            elif kind == "grow":
                grown = pools["q"].capacity if operation[1] == "q:1" else capacity
                grown[operation[1]] = grown.get(operation[1], 0) + operation[2]
                queue.notify()
            await settle()
            for fleet in pools.values():
                for address, limit in fleet.capacity.items():
                    assert slots.in_flight(address) <= limit
            assert queue.queue_length <= max_size
        for task in waiting():
            task.cancel()
        await settle()
        for slot in holding():
            queue.release(slot)
            released.append(slot)
        assert not waiting() and queue.queue_length == 0
        assert slots.total == 0 and slots.taken == slots.given
        assert all(slot.released for slot in admitted())
        assert len({id(slot) for slot in released}) == len(released) == len(admitted())
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                assert isinstance(task.exception(), QueueFull)

    run(main)
