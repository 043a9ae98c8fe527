"""Fixtures of the image tests: the two images, built (or found in podman's store) once
per session; without a working podman every test here is skipped with one line."""

from __future__ import annotations

import pytest

from tests.images.containers import ENGINE, OPERATOR, ensure_built, unavailable


@pytest.fixture(scope="session")
def podman_available() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def engine_image(podman_available: None) -> str:
    return ensure_built(ENGINE)


@pytest.fixture(scope="session")
def operator_image(podman_available: None) -> str:
    return ensure_built(OPERATOR)
