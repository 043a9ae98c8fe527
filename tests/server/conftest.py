"""Fixtures of the engine-server tests (the launchers live in ``tests.support``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.engine_server import RunningServer, start_server, stop_server


@pytest.fixture(scope="module")
def server(checkpoint_dir) -> Iterator[RunningServer]:  # type: ignore[no-untyped-def]
    srv = start_server(checkpoint_dir("llama"), block_size=4)
    yield srv
    stop_server(srv)
