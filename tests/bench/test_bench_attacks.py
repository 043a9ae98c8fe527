"""``kvserve bench attacks`` runs every phase against a real replica and reports each
figure with its target (the figures themselves are not asserted: timings vary)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.mark.slow
def test_every_phase_runs_and_is_reported(checkpoint_dir: Callable[[str], Path]) -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvserve", "bench", "attacks",
            "--model", str(checkpoint_dir("llama")), "--attackers", "1",
            "--victim-tokens", "8", "--victim-streams", "1", "--flood-mb", "1",
            "--stalled-streams", "2", "--stalled-tokens", "8", "--header-timeout", "2",
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for phase in ("baseline", "load", "stops", "huge", "flood"):
        assert f"\n{phase} " in out, out
    assert " TPOT (target <= 1.2)" in out and "/health p99" in out
    assert "replica CPU, idle %" in out and "refusals paced to 20 a second" in out
    assert "huge vs flood (the same loop of refused requests, 60-byte bodies)" in out
    assert "streams that stop reading (8 tokens, top_logprobs 20): peak RSS" in out
    assert "header floods: peak RSS" in out
    assert "a head sent a byte a second: 'HTTP/1.1 408 Request Timeout'" in out, out
