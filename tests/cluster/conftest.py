"""Helpers for tests against the control plane (the fixture is in tests/conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(what: str, check: Callable[[], T], timeout: float = 60.0) -> T:
    """Call ``check`` until it returns something truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")
