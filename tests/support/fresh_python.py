"""Run code in a fresh interpreter, to see which modules it loads (start-up cost tests)."""

from __future__ import annotations

import json
import subprocess
import sys


def heavy_modules_after(code: str, heavy: set[str], timeout: float = 120) -> set[str]:
    """The modules of ``heavy`` that ``sys.modules`` holds once ``code`` has run in a new
    interpreter (``code`` failing fails the caller, with its stderr)."""
    report = f"print(json.dumps(sorted(set({sorted(heavy)!r}) & set(sys.modules))))"
    probe = f"{code}\nimport json, sys\n{report}"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))
