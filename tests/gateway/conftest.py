"""Fixtures of the gateway tests: real replica processes and an in-process gateway
(the launchers live in ``tests.support``). Everything is stopped at the end of the session,
module or test that started it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.gateway import Gateway, start_gateway
from tests.support.replicas import Replica


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir: Callable[[str], Path]) -> Path:
    return checkpoint_dir("llama")


@pytest.fixture(scope="session")
def replicas(shared_replicas: list[Replica]) -> list[Replica]:
    return shared_replicas


@pytest.fixture
def gateway(replicas: list[Replica]) -> Iterator[Gateway]:
    gw = start_gateway(replicas)
    yield gw
    gw.stop()
