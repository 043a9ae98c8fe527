"""CPU accounting for the benchmarks: how many CPUs this process may use, and how busy
the whole machine has been (so a report can say what else competed for the CPUs)."""

from __future__ import annotations

import os
from pathlib import Path


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
