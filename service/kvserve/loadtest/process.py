"""Running Locust as a child process, so that Ctrl-C ends a run with its report."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Any

# After Ctrl-C, how long Locust may take to stop its users and write its report (its
# --stop-timeout bounds the users; the report takes a moment more).
REPORT_GRACE_S = 30.0


def run_locust(argv: Sequence[str], **popen_kw: Any) -> int:
    """Locust's exit status. A terminal's Ctrl-C reaches Locust too (one process group):
    it stops and writes its report and summary, so this waits for it rather than kill
    it (``subprocess.run`` kills the child a quarter second after the interrupt, and
    the run's outputs were lost); a second Ctrl-C, or REPORT_GRACE_S, stops the wait."""
    proc = subprocess.Popen(list(argv), **popen_kw)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=REPORT_GRACE_S)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        raise
