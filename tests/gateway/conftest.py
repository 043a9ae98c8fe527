"""Fixtures of the gateway tests: real replica processes and an in-process gateway
(the launchers live in ``tests.support``). Everything is stopped at the end of the module
or test that started it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.gateway import Gateway, start_gateway
from tests.support.replicas import Replica, start_replicas


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir: Callable[[str], Path]) -> Path:
    return checkpoint_dir("llama")


@pytest.fixture(scope="module")
def replicas(model_dir: Path) -> Iterator[list[Replica]]:
    reps = start_replicas(model_dir, 2)
    yield reps
    for rep in reps:
        rep.stop()


@pytest.fixture
def gateway(replicas: list[Replica]) -> Iterator[Gateway]:
    gw = start_gateway(replicas)
    yield gw
    gw.stop()
