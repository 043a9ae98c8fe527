"""Child processes of the benchmarks: start them with their output in a log file, wait
until they answer, read their CPU time and peak memory, stop them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

STARTUP_POLL_S = 0.1  # how often readiness is polled (each poll has a deadline)
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this long


@dataclass
class Proc:
    """A child process (replica or gateway) with its output in a log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def cpu_seconds(self) -> float:
        """utime + stime of the process (all its threads) so far, from /proc/PID/stat."""
        stat = Path(f"/proc/{self.popen.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_bytes(self) -> int | None:
        """The most resident memory the process has had (VmHWM in /proc/PID/status), or
        None where /proc does not say."""
        peak = proc_field(f"/proc/{self.popen.pid}/status", "VmHWM:")  # "1234 kB"
        return None if peak is None else int(peak.split()[0]) * 1024

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with status {self.popen.returncode}; its log ends:\n"
                + self.tail()
            )


# Runs a command on given CPUs: sets the affinity, then execs the command, which keeps it
# (as does every thread the command starts, unlike pinning a process after it started).
_ON_CPUS = (
    "import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def proc_field(path: str, prefix: str) -> str | None:
    """What follows ``prefix`` on the first line of a /proc file that starts with it (None:
    no such line, or no such file)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((ln[len(prefix) :].strip(" \t:") for ln in lines if ln.startswith(prefix)), None)


def spawn(
    name: str,
    argv: list[str],
    log: Path,
    env: dict[str, str],
    cpus: Collection[int] | None = None,
) -> Proc:
    """Start ``argv`` with its output in ``log``; on ``cpus`` only when given."""
    if cpus is not None:
        argv = [sys.executable, "-c", _ON_CPUS, ",".join(map(str, sorted(cpus))), *argv]
    with log.open("wb") as out:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            # Parents like make or CI may ignore SIGINT, and children inherit that; a
            # child must die on Ctrl-C like this process does.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    return Proc(name, popen, log)


def stop(procs: Sequence[Proc]) -> None:
    """SIGTERM to all at once, then SIGKILL whatever is still running after the grace."""
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all held open until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_listening(proc: Proc, port: int, deadline: float) -> None:
    """Poll until something accepts TCP connections on 127.0.0.1:``port`` (a process
    without an HTTP readiness endpoint), the process dies, or the deadline passes."""

    def listening() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return True
        except OSError:
            return False

    _wait(proc, listening, deadline, f"did not listen on port {port}")


def wait_ready(
    proc: Proc, url: str, deadline: float, ok: Callable[[httpx.Response], bool] | None = None
) -> None:
    """Poll ``url`` until it answers 200 (and ``ok(response)``), the process dies, or the
    deadline passes."""
    import httpx

    def ready() -> bool:
        try:
            r = httpx.get(url, timeout=5)
        except httpx.TransportError:
            return False
        return r.status_code == 200 and (ok is None or ok(r))

    _wait(proc, ready, deadline, "was not ready within the deadline")


def _wait(proc: Proc, check: Callable[[], bool], deadline: float, failure: str) -> None:
    while True:
        proc.check_alive()
        if check():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} {failure}; log:\n{proc.tail()}")
        time.sleep(STARTUP_POLL_S)
