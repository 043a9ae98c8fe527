"""Processes a test starts keep their output in a temp file, shown when the test fails."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

# The last this many bytes of a process's log are shown with a failure.
LOG_TAIL_BYTES = 16_000


class LoggedProcess(subprocess.Popen[bytes]):
    """A ``subprocess.Popen`` whose stdout and stderr go to a temp file (``log``)."""

    def __init__(self, args: Sequence[str], name: str, **popen_kw: Any) -> None:
        self.name = name
        self._file: IO[bytes] = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept open
            prefix=f"kvserve-test-{name}-", suffix=".log", delete=False
        )
        self.log = Path(self._file.name)
        super().__init__(list(args), stdout=self._file, stderr=subprocess.STDOUT, **popen_kw)

    def tail(self) -> str:
        """The end of its output, titled, as a failure report shows it."""
        data = self.log.read_bytes() if self.log.exists() else b""
        text = data[-LOG_TAIL_BYTES:].decode(errors="replace")
        return f"---- {self.name} (pid {self.pid}) output, last {len(text)} chars ----\n{text}"

    def stop(self) -> None:
        """Kill it if it still runs (the log stays until the session ends)."""
        if self.poll() is None:
            self.kill()
            self.wait(timeout=30)
        self._file.close()

    def remove_log(self) -> None:
        self.log.unlink(missing_ok=True)


# Every process started in the current test session, for the failure report.
STARTED: list[LoggedProcess] = []


def start_logged(args: Sequence[str], name: str, **popen_kw: Any) -> LoggedProcess:
    proc = LoggedProcess(args, name, **popen_kw)
    STARTED.append(proc)
    return proc


def reports_since(started: float) -> list[tuple[str, str]]:
    """(title, log tail) of each process that runs now or wrote output since ``started``
    (a ``time.time()``): what a failing test shows (tests/conftest.py)."""
    shown = []
    for proc in STARTED:
        recent = proc.log.exists() and proc.log.stat().st_mtime >= started
        if proc.poll() is None or recent:
            shown.append((f"process {proc.name}", proc.tail()))
    return shown


def remove_logs() -> None:
    """At the end of the session: stop what is left and delete every log."""
    for proc in STARTED:
        proc.stop()
        proc.remove_log()
    STARTED.clear()


def run_into_closed_pipe(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run ``args`` with standard output a pipe whose reader is already gone (what
    ``cmd | head -1`` comes to once head has its line); stderr is captured."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            list(args),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
