"""Requests in flight per replica, as this gateway counts them (admission takes and gives
the slots; routing reads the counts)."""

from __future__ import annotations


class ReplicaSlots:
    """In-flight request count per replica address: what ``ReplicaLoad.in_flight`` reads.

    Counts only what this gateway sent, so it is exact and current (unlike a replica's
    ``GetLoad``, which is one poll old).
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def take(self, address: str) -> None:
        self._counts[address] = self._counts.get(address, 0) + 1

    def give(self, address: str) -> None:
        count = self._counts.get(address, 0)
        if count <= 0:
            raise ValueError(f"no slot in use on {address!r} to give back (double release?)")
        if count == 1:
            del self._counts[address]  # replicas come and go: keep no empty entries
        else:
            self._counts[address] = count - 1

    def in_flight(self, address: str) -> int:
        return self._counts.get(address, 0)

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def snapshot(self) -> dict[str, int]:
        """Addresses with at least one request in flight → count."""
        return dict(self._counts)
