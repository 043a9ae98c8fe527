"""Waiting for a condition with a deadline (never a bare sleep as synchronisation)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.01)


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


async def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """``wait_until`` on an event loop: poll ``predicate`` without blocking the loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(0.005)
