"""Refusals answered at a bounded rate, so that a flood of bad requests cannot take a
server's CPU away from the good ones (docs/security.md, "Refusal pacing").

Refusing a request is cheap but not free: accepting the connection, parsing its head,
deciding, answering and closing cost a replica 0.2-0.5 ms of CPU, and a 4 MB body refused
unread ~1 ms, the kernel's freeing of it included (docs/security.md). A client that loops
on requests the server refuses -- 4 MB prompts answered 413, an unknown model, a missing
key -- gets its answers as fast as the server can give them, so the server spends its CPU
on refusing: four such clients made a one-CPU replica's other streams 1.4-1.8x slower.
Good requests must not wait, so the server does not refuse faster; it *answers* refusals
no faster than ``per_second`` (after a burst of ``burst``), holding each one until its
turn. A client that waits for its answer before sending again, which is what HTTP clients
do, is slowed to that pace, and so is the CPU it costs.

The pace is a GCRA (the virtual-scheduling form of a token bucket): each refusal takes
the next free slot, ``1 / per_second`` apart, and ``burst`` may be answered at once. A
refusal is never held longer than ``max_delay``: past that, the clients have more
requests in flight than pacing can slow down, and holding more of them would only cost
memory. Only answers with a 4xx status are paced; successful requests, 5xx and a
draining server's 503s are never held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("kvserve.refusals")

# A replica sits behind the gateway, which refuses what it can first: a replica's 4xx are
# rare unless a client on the cluster network misbehaves. At 20 a second, four clients
# looping on 4 MB bodies cost a one-CPU replica ~2% of its CPU, against 22% unpaced
# (docs/security.md, "Measured").
REPLICA_REFUSALS_PER_SECOND = 20.0
# The gateway is the public entry: its 401s and 429s are routine with many tenants.
GATEWAY_REFUSALS_PER_SECOND = 100.0
DEFAULT_MAX_DELAY = 2.0
REPORT_EVERY = 60.0  # seconds between log lines while refusals are being held


def is_refusal(status: int) -> bool:
    """Whether an answer with ``status`` is paced: client errors (4xx)."""
    return 400 <= status < 500


@dataclass
class RefusalPacer:
    """How long to hold each refusal. ``per_second`` 0 turns pacing off."""

    per_second: float = REPLICA_REFUSALS_PER_SECOND
    burst: int = int(REPLICA_REFUSALS_PER_SECOND)
    max_delay: float = DEFAULT_MAX_DELAY
    clock: Callable[[], float] = time.monotonic
    _tat: float = field(default=float("-inf"), init=False)  # the next slot's time
    _held: int = field(default=0, init=False)  # refusals held since the last report
    _reported: float = field(default=float("-inf"), init=False)

    @classmethod
    def at(cls, per_second: float) -> RefusalPacer:
        """Pacing to ``per_second`` after a burst of one second's worth (0: off)."""
        return cls(per_second, max(1, int(per_second)))

    def __post_init__(self) -> None:
        if not 0 <= self.per_second < float("inf"):
            raise ValueError(f"refusals per second must be finite and >= 0, not {self.per_second}")
        if self.burst < 1:
            raise ValueError(f"the refusal burst must be >= 1, not {self.burst}")

    def delay(self) -> float:
        """Seconds to hold the refusal about to be answered (0: answer now)."""
        if self.per_second == 0:
            return 0.0
        now = self.clock()
        interval = 1.0 / self.per_second
        slot = max(self._tat, now)
        wait = slot - (self.burst - 1) * interval - now
        if wait <= 0:
            self._tat = slot + interval
            return 0.0
        if wait > self.max_delay:  # no slot taken: the excess waits the longest, alone
            wait = self.max_delay
        else:
            self._tat = slot + interval
        self._held += 1
        if now - self._reported >= REPORT_EVERY:
            log.warning(
                "refusals paced to %g a second: %d held since the last report (a client "
                "is looping on requests this server refuses)",
                self.per_second,
                self._held,
            )
            self._held, self._reported = 0, now
        return wait
