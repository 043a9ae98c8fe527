"""The benchmarks' child processes: CPU placement survives the exec into the command, and
the peak memory read from /proc is the child's."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from kvserve.bench.cpu import running_on, split_cpus
from kvserve.bench.processes import spawn, stop

# Prints the affinity of a thread the command starts (threads inherit it from their parent).
SHOW_AFFINITY = (
    "import os, threading\n"
    "t = threading.Thread(target=lambda: print(sorted(os.sched_getaffinity(0))))\n"
    "t.start()\n"
    "t.join()\n"
)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_child_and_its_threads_run_on_the_given_cpus(tmp_path: Path) -> None:
    first = min(os.sched_getaffinity(0))
    log = tmp_path / "child.log"
    proc = spawn("child", [sys.executable, "-c", SHOW_AFFINITY], log, dict(os.environ), {first})
    assert proc.popen.wait(timeout=60) == 0
    stop([proc])
    assert log.read_text().strip() == str([first])


def test_split_gives_the_gateway_one_cpu_and_the_rest_the_others() -> None:
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    placement = split_cpus(separate=True)
    if len(cpus) < 2:
        assert not placement.separate
        return
    assert placement.gateway is not None and placement.others is not None
    assert len(placement.gateway) == 1
    assert placement.gateway | placement.others == cpus
    assert not placement.gateway & placement.others
    assert not split_cpus(separate=False).separate
    with running_on(placement.others):
        assert os.sched_getaffinity(0) == placement.others
    assert os.sched_getaffinity(0) == cpus


# Touches 64 MiB, says so, then waits to be stopped (stop() sends SIGTERM).
HOLD_64_MIB = (
    "import signal\n"
    "block = bytearray(64 << 20)\n"
    "print('holding', len(block), flush=True)\n"
    "signal.pause()\n"
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="no /proc here")
def test_peak_memory_is_read_from_the_child(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    proc = spawn("child", [sys.executable, "-c", HOLD_64_MIB], log, dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while "holding" not in log.read_text():
            assert proc.popen.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the child never allocated its block"
            time.sleep(0.05)
        peak = proc.peak_rss_bytes()
    finally:
        stop([proc])
    assert peak is not None
    assert 64 << 20 <= peak < 512 << 20
    assert proc.peak_rss_bytes() is None  # gone with the process
