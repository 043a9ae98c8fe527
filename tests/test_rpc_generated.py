"""The committed gRPC code is what ``engine.proto`` compiles to, and asks for no newer
grpcio or protobuf at run time than pyproject.toml installs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from kvserve.rpc import generate

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_committed_code_is_what_the_proto_compiles_to(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert generate.main(["--check"]) == 0, capsys.readouterr().err


def test_a_stale_file_is_found(tmp_path: Path) -> None:
    """The check compares code, not only the version stamps it leaves out."""
    (generated,) = [p for p in generate.generate(tmp_path) if p.name == "engine_pb2.py"]
    committed = generate.PACKAGE_DIR / "engine_pb2.py"
    assert not generate.differs_in_code(committed, generated)
    generated.write_text(generated.read_text().replace("prompt_tokens", "prompt_tokenz", 1))
    assert generate.differs_in_code(committed, generated)


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_the_stamped_versions_are_at_most_what_pyproject_requires() -> None:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    minimum = {}
    for requirement in dependencies:
        if (found := re.match(r"(grpcio|protobuf)>=([\d.]+)", requirement)) is not None:
            minimum[found[1]] = found[2]
    for package, stamped in generate.stamped_versions().items():
        assert version(stamped) <= version(minimum[package]), (package, stamped, minimum)
