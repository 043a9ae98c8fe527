"""CPU accounting for the benchmarks: usable CPUs, the CPU time of a window of work (this
process, its children, the rest of the machine), and the gateway benchmarks' placement."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.bench.processes import Proc


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; the CPU count off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_busy_seconds() -> float:
    """CPU seconds all CPUs have spent busy since boot: user + nice + system + irq +
    softirq from /proc/stat (idle, iowait and steal are not work done here). Raises
    OSError where there is no /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuUse:
    """CPU seconds spent over a window of wall time: by this process, by each watched
    child process, and by every other process on the machine (None where there is no
    /proc/stat)."""

    wall: float = 0.0
    own: float = 0.0
    children: list[float] = field(default_factory=list)
    others: float | None = None


@contextlib.contextmanager
def cpu_use(children: Sequence[Proc] = ()) -> Iterator[CpuUse]:
    """Measure what the body of the ``with`` costs; the ``CpuUse`` it yields is filled
    in when the body ends."""

    def reading() -> tuple[float, float, list[float], float | None]:
        own, procs = time.process_time(), [p.cpu_seconds() for p in children]
        try:
            machine: float | None = machine_busy_seconds()
        except (OSError, ValueError):
            machine = None
        return time.perf_counter(), own, procs, machine

    use = CpuUse()
    wall, own, procs, machine = reading()
    yield use
    wall_end, own_end, procs_end, machine_end = reading()
    use.wall, use.own = wall_end - wall, own_end - own
    use.children = [b - a for a, b in zip(procs, procs_end, strict=True)]
    if machine is not None and machine_end is not None:
        use.others = max(0.0, machine_end - machine - use.own - sum(use.children))


@dataclass(frozen=True)
class Placement:
    """Where the gateway benchmarks run their processes: the gateway alone on its CPU and
    everything else on the rest, or (``None`` for both) all on every CPU."""

    gateway: frozenset[int] | None
    others: frozenset[int] | None

    @property
    def separate(self) -> bool:
        return self.gateway is not None

    def describe(self) -> str:
        if self.gateway is None or self.others is None:
            return "shared: every process may run on every CPU"
        return (
            f"separate: the gateway alone on CPU {cpu_list(self.gateway)}, everything else "
            f"on CPU {cpu_list(self.others)}"
        )


def cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def split_cpus(separate: bool) -> Placement:
    """The gateway gets the first usable CPU and the rest the others, when asked and when
    there are at least two (Linux only); otherwise nothing is pinned."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no affinity
        return Placement(None, None)
    if not separate or len(cpus) < 2:
        return Placement(None, None)
    return Placement(frozenset(cpus[:1]), frozenset(cpus[1:]))


@contextlib.contextmanager
def running_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run this thread (and the threads it starts meanwhile) on ``cpus`` (None: as is)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
