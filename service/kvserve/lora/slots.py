"""Which adapters sit in the compute device's ``max_loras`` slots.

The scheduler asks before it admits a request (``reserve``), pins the slot while the
request runs (``pin``) and unpins it when the request is preempted or ends (``unpin``).

Invariants:

- an adapter is in at most one slot, and a slot's adapter changes only while nobody pins
  it (``pins[s]`` = running requests whose adapter is in slot ``s``);
- a free slot is filled before an occupied one is reused, and among unpinned occupied
  slots the least recently used is reused first;
- when no slot can take a request's adapter (every slot pinned by other adapters), that
  request waits and one pinned slot is *draining* for the rest of the step: no request
  scanned after it (so: no younger request) is admitted to that adapter. Requests for
  the base model and for other resident adapters still pass. The draining slot's running
  requests end, it unpins, and the waiting request takes it: a request for a missing
  adapter waits a bounded time and never stops the others. With nothing running no slot
  is pinned, so some request can always be admitted (no deadlock).

The slots hold keys (``LoRARequest`` in the engine); ``load(slot, key)`` puts an adapter's
weights into a slot. Nothing here knows tensors, so the scheduler's property tests run
it with a fake ``load``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable


class SlotTable:
    def __init__(self, num_slots: int, load: Callable[[int, Hashable], None]) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        self._load = load
        self.keys: list[Hashable | None] = [None] * num_slots
        self.pins = [0] * num_slots
        self._used = [0] * num_slots  # last reserve/pin, for LRU
        self._clock = itertools.count(1)
        self.draining: int | None = None  # the slot held for a waiting request, this step
        self.loads = 0  # adapters put into slots so far (a statistic)

    def slot_of(self, key: Hashable) -> int | None:
        try:
            return self.keys.index(key)
        except ValueError:
            return None

    def begin_step(self) -> None:
        """A new scheduling pass: the oldest blocked request chooses the draining slot anew."""
        self.draining = None

    def reserve(self, key: Hashable) -> bool:
        """Make ``key`` resident if it can be now; False means: wait for a slot."""
        slot = self.slot_of(key)
        if slot is not None:
            if slot == self.draining:
                return False  # held for an older request that needs a slot
            self._used[slot] = next(self._clock)
            return True
        free = [s for s in range(self.num_slots) if self.pins[s] == 0 and s != self.draining]
        if free:
            # Empty slots first, then the least recently used adapter.
            slot = min(free, key=lambda s: (self.keys[s] is not None, self._used[s]))
            self._load(slot, key)
            self.keys[slot] = key
            self._used[slot] = next(self._clock)
            self.loads += 1
            return True
        if self.draining is None:
            self.draining = min(range(self.num_slots), key=lambda s: self._used[s])
        return False

    def pin(self, key: Hashable) -> int:
        """A request for ``key`` (reserved just before) starts running; its slot."""
        slot = self.slot_of(key)
        assert slot is not None, f"{key!r} was not reserved"
        self.pins[slot] += 1
        self._used[slot] = next(self._clock)
        return slot

    def unpin(self, key: Hashable) -> None:
        """A running request for ``key`` was preempted or ended."""
        slot = self.slot_of(key)
        assert slot is not None and self.pins[slot] > 0, f"{key!r} is not pinned"
        self.pins[slot] -= 1

    def pinned(self, key: Hashable) -> bool:
        slot = self.slot_of(key)
        return slot is not None and self.pins[slot] > 0

    def evict(self, key: Hashable) -> bool:
        """Empty ``key``'s slot if nobody runs on it (an unloaded adapter); True if done."""
        slot = self.slot_of(key)
        if slot is None or self.pins[slot]:
            return slot is None
        self.keys[slot] = None
        self._used[slot] = 0
        return True

    @property
    def resident(self) -> list[Hashable]:
        return [k for k in self.keys if k is not None]

    @property
    def running(self) -> list[Hashable]:
        """Adapters with running requests."""
        return [
            k for k, n in zip(list(self.keys), list(self.pins), strict=True) if k is not None and n
        ]
