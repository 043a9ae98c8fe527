"""The helper that keeps torch's OpenMP team on one live thread at a time."""

from __future__ import annotations

import threading

import pytest

from kvserve.engine.cpu_threads import call_in_short_lived_thread


def test_returns_the_result_from_another_thread_that_is_gone_afterwards() -> None:
    before = set(threading.enumerate())
    worker = call_in_short_lived_thread(threading.current_thread)
    assert worker is not threading.current_thread()
    assert not worker.is_alive()
    assert set(threading.enumerate()) == before


def test_passes_arguments_and_reraises_the_error_in_the_caller() -> None:
    assert call_in_short_lived_thread(divmod, 7, 2) == (3, 1)
    with pytest.raises(ZeroDivisionError):
        call_in_short_lived_thread(divmod, 1, 0)
