"""The clean-up after an image build (``remove_stale_layers``), on two builds of a small
two-stage image made here on a base of its own: the first build's stage, which only
that build reached, goes; the second build's stage (kept, as a build's steps are) and
its tagged image stay; nothing built on another base is touched."""

from __future__ import annotations

import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.images.containers import ULIMITS, build_steps, podman, remove_stale_layers

DOCKERFILE = """\
FROM {base} AS stage
COPY version.txt /version.txt
FROM {base}
COPY --from=stage /version.txt /copied.txt
"""


def _build(context: Path, base: str, version: str, tag: str) -> list[str]:
    (context / "Dockerfile").write_text(DOCKERFILE.format(base=base))
    (context / "version.txt").write_text(version)
    built = podman(
        "build", "--layers", *ULIMITS, "-t", tag, "-f", str(context / "Dockerfile"),
        str(context), timeout=300,
    )  # fmt: skip
    return build_steps(built.stdout + built.stderr)


def _images() -> set[str]:
    listed = podman("images", "--all", "--no-trunc", "--format", "{{.ID}}").stdout
    return {image.removeprefix("sha256:") for image in listed.split()}


@pytest.fixture
def base(podman_available: None, tmp_path: Path) -> Iterator[str]:
    """A base image of this test's own: one file, imported from a tar."""
    name = f"localhost/kvserve-test-stale-base:{uuid.uuid4().hex[:8]}"
    (tmp_path / "hello.txt").write_text("hello\n")
    with tarfile.open(tmp_path / "base.tar", "w") as tar:
        tar.add(tmp_path / "hello.txt", arcname="hello.txt")
    podman("import", str(tmp_path / "base.tar"), name)
    before = _images()
    try:
        yield name
    finally:
        podman("rmi", "--force", *(_images() - before), check=False)
        podman("rmi", "--force", name, check=False)


def test_the_stages_only_an_earlier_build_reached_are_removed(base: str, tmp_path: Path) -> None:
    others = _images()  # built on other bases, or on none
    repository = f"localhost/kvserve-test-stale-{uuid.uuid4().hex[:8]}"
    first = _build(tmp_path, base, "1", f"{repository}:1")
    second = _build(tmp_path, base, "2", f"{repository}:2")
    podman("rmi", f"{repository}:1")
    first_stage, second_stage = first[0], second[0]  # the stage's COPY, in each build
    assert first_stage != second_stage
    removed = remove_stale_layers(base, keep=set(second))
    assert [image[: len(first_stage)] for image in removed] == [first_stage]
    left = _images()
    assert others <= left
    assert any(image.startswith(second_stage) for image in left)
    assert podman("image", "exists", f"{repository}:2", check=False).returncode == 0
