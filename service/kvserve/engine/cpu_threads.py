"""Keep PyTorch's CPU compute on one thread at a time.

PyTorch's CPU wheels parallelise with GNU OpenMP (libgomp), and libgomp keeps one thread
team per thread that has ever entered a parallel region, for as long as that thread
lives. When the teams together hold more threads than there are CPUs, libgomp throttles
its workers: they spin for ~1000 iterations instead of ~3 ms between parallel regions and
then sleep on a futex, so every matmul of a decode step pays a wake-up. On the 2-core dev
host, a server whose main thread loaded the model (one team) and whose engine thread runs
the steps (a second team) stepped 30-50% slower than the same engine in a lone thread.

So a server loads its model in a short-lived thread: when that thread exits, its team is
released, and the engine thread's team is the only one left. (The event loop's thread
never computes with torch.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def call_in_short_lived_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn(*args, **kwargs)`` in a new thread, wait, and return its result or raise.

    The thread, and with it any OpenMP thread team it created, is gone when this returns.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    # A daemon, so that Ctrl-C during a long load still ends the process.
    thread = threading.Thread(target=target, name="kvserve-torch", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
