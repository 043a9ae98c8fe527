"""Fixtures of the image tests: the two images, built (or found in podman's store) once
per session; without a working podman, or without the disk room to build an image, the
tests that need it are skipped with one line."""

from __future__ import annotations

import pytest

from tests.images.containers import (
    ENGINE,
    OPERATOR,
    ImageSpec,
    NotBuildable,
    ensure_built,
    unavailable,
)


@pytest.fixture(scope="session")
def podman_available() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


def _built(spec: ImageSpec) -> str:
    try:
        return ensure_built(spec)
    except NotBuildable as reason:  # too little disk for the build
        pytest.skip(str(reason))


@pytest.fixture(scope="session")
def engine_image(podman_available: None) -> str:
    return _built(ENGINE)


@pytest.fixture(scope="session")
def operator_image(podman_available: None) -> str:
    return _built(OPERATOR)
