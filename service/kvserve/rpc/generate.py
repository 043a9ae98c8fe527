"""Regenerate the gRPC code next to ``engine.proto``: ``python -m kvserve.rpc.generate``.

Writes ``engine_pb2.py``, ``engine_pb2.pyi`` and ``engine_pb2_grpc.py`` (commit them).
The proto is compiled with ``service/`` as its root, under its package path
``kvserve/rpc/engine.proto``, so the generated service module imports its
messages as ``from kvserve.rpc import engine_pb2`` (no ``sys.path`` tricks).

``--check`` regenerates into a temporary folder and fails if the committed files differ
in anything but the versions of the tools that wrote them (``stamped_versions``): a newer
grpcio-tools writes the same code with its own version in it, which then demands at least
that runtime, so the committed files keep the versions that pyproject.toml requires.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from importlib.resources import files
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parents[1]  # .../service: the folder that holds ``kvserve/``
PROTO = PACKAGE_DIR.relative_to(SOURCE_ROOT) / "engine.proto"
GENERATED = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")
# Where the generated files name the versions of the tools that wrote them.
_GRPC_VERSION = re.compile(r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", re.M)
_PROTOBUF_VERSION = re.compile(r"^# Protobuf Python Version: ([\d.]+)$", re.M)
_PROTOBUF_CHECK = re.compile(r"(ValidateProtobufRuntimeVersion\(\s*\S+,\s*)\d+,\s*\d+,\s*\d+,")
HEADER = (
    "# Generated from engine.proto by `python -m kvserve.rpc.generate`. DO NOT EDIT.\n"
    "# mypy: ignore-errors\n"
    "# ruff: noqa\n"
)


def generate(out_root: Path) -> list[Path]:
    """Compile the proto into ``out_root`` (laid out like ``service/``); return the files."""
    from grpc_tools import protoc

    well_known = files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"--proto_path={SOURCE_ROOT}",
        f"--proto_path={well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        PROTO.as_posix(),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed (exit {rc}) on {SOURCE_ROOT / PROTO}")
    out_dir = out_root / PROTO.parent
    paths = [out_dir / name for name in GENERATED]
    for path in paths:
        if not path.exists():
            raise RuntimeError(f"protoc did not write {path}")
        text = path.read_text(encoding="utf-8")
        if not text.startswith(HEADER):
            path.write_text(HEADER + text, encoding="utf-8")
    grpc_module = out_dir / "engine_pb2_grpc.py"
    expected = "from kvserve.rpc import engine_pb2"
    if expected not in grpc_module.read_text(encoding="utf-8"):
        raise RuntimeError(f"{grpc_module} does not import its messages as {expected!r}")
    return paths


def stamped_versions(package_dir: Path = PACKAGE_DIR) -> dict[str, str]:
    """The grpcio and protobuf versions the committed files were written for (each is the
    least runtime version the generated code accepts)."""
    grpc_match = _GRPC_VERSION.search((package_dir / "engine_pb2_grpc.py").read_text())
    protobuf_match = _PROTOBUF_VERSION.search((package_dir / "engine_pb2.py").read_text())
    if grpc_match is None or protobuf_match is None:
        raise RuntimeError(f"no version stamps found in {package_dir}")
    return {"grpcio": grpc_match[1], "protobuf": protobuf_match[1]}


def _without_versions(text: str) -> str:
    text = _GRPC_VERSION.sub("GRPC_GENERATED_VERSION = ?", text)
    text = _PROTOBUF_VERSION.sub("# Protobuf Python Version: ?", text)
    return _PROTOBUF_CHECK.sub(r"\1?,", text)


def differs_in_code(committed: Path, generated: Path) -> bool:
    """Whether ``committed`` is not ``generated`` (the same file, freshly written), its
    version stamps aside."""
    if not committed.exists():
        return True
    return _without_versions(committed.read_text()) != _without_versions(generated.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--check", action="store_true", help="fail if the committed files are out of date"
    )
    args = parser.parse_args(argv)
    if not args.check:
        for path in generate(SOURCE_ROOT):
            print(f"wrote {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [
            path.name
            for path in generate(Path(tmp))
            if differs_in_code(PACKAGE_DIR / path.name, path)
        ]
    if stale:
        print(
            f"out of date: {', '.join(stale)}; run `python -m kvserve.rpc.generate` "
            "and commit the result",
            file=sys.stderr,
        )
        return 1
    print("generated gRPC code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
