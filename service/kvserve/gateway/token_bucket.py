"""A token bucket (capacity = a per-minute limit, refilled continuously at limit/60 per
second, starting full), and the ``x-ratelimit-*`` headers it answers with.

Headers (OpenAI's names, lowercase): ``x-ratelimit-limit-requests`` (the per-minute
limit), ``x-ratelimit-remaining-requests`` (whole requests left in the bucket now),
``x-ratelimit-reset-requests`` (time until the bucket is full again), and the same three
with ``-tokens``. Durations use OpenAI's (Go's) format rounded up to the millisecond:
``"0s"``, ``"250ms"``, ``"1s"``, ``"1.5s"``, ``"59.999s"``, ``"1m0s"``, ``"6m0s"``,
``"1h2m3s"``. On 429 also ``retry-after``: whole seconds, rounded up, at least 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EPSILON = 1e-9  # float slack: a refill that should land exactly on 1.0 may give 0.9999…


def format_duration(seconds: float) -> str:
    """OpenAI's reset format (Go's ``time.Duration``), rounded up to whole milliseconds."""
    ms = math.ceil(seconds * 1000 - 1e-6)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    out = f"{whole}.{frac:03d}".rstrip("0") + "s" if frac else f"{whole}s"
    if hours or minutes:
        out = f"{minutes}m{out}"
    if hours:
        out = f"{hours}h{out}"
    return out


def retry_after_header(seconds: float) -> str:
    """``Retry-After``: integer seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(seconds - EPSILON)))


@dataclass
class TokenBucket:
    """``level`` units available out of ``capacity``; refills at capacity/60 per second."""

    capacity: int
    level: float
    updated: float  # clock time of the last refill

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        # Refilling is not consuming: it only brings the level up to date, so doing it
        # before a rejection keeps admission atomic.
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def has(self, amount: float) -> bool:
        return self.level + EPSILON >= amount

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0 if it is now)."""
        return 0.0 if self.has(amount) else (amount - self.level) / self.rate

    def until_full(self) -> float:
        return max(0.0, (self.capacity - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self.level = max(0.0, self.level - amount)

    def charge(self, amount: float) -> None:
        """Take ``amount`` even if it is not there: the shortfall becomes debt."""
        self.level -= amount

    def give(self, amount: float) -> None:
        self.level = min(float(self.capacity), self.level + amount)

    def resize(self, capacity: int) -> None:
        """New limit, same usage: what was used stays used (clamped to the new range); a
        debt stays owed, and a smaller limit creates none."""
        used = self.capacity - self.level
        self.capacity = capacity
        self.level = min(float(capacity), max(min(0.0, self.level), capacity - used))

    def headers(self, kind: str) -> dict[str, str]:
        return {
            f"x-ratelimit-limit-{kind}": str(self.capacity),
            f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(self.level + EPSILON))),
            f"x-ratelimit-reset-{kind}": format_duration(self.until_full()),
        }
