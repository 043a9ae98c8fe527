"""Create the virtualenv and install kvserve into it, keeping the disk's peak low.

    python3 scripts/install_venv.py VENV [--min-free-gb GB] PIP_INSTALL_ARGS...

`make install` (and so `make run` and `make test`) runs this. pip downloads every wheel
of an install before it installs any, and deletes them only at the end, so a single
`pip install -e '.[test]'` into an empty virtualenv needs the virtualenv's 6.3 GB and
the 3.1 GB of downloads at once: 9.4 GB at the peak (measured on 2026-12-06, PyTorch 2.15
from PyPI, whose Linux wheel brings its CUDA libraries). PyTorch and those libraries are
most of both, so they go first, one `pip install` each (the very file that the whole
install resolves to, without dependencies, and without pip's cache, which would
keep a second copy), and one ordinary `pip install` does the rest, with the heavy
packages already there: the peak becomes the virtualenv plus one step's downloads, 6.55 GB
for a 6.36 GB virtualenv (measured the same day, 40 s slower than one `pip install`).
Packages that carry older copies of another package's files (``OVERWRITABLE``) also go
first, so that the owner's files are the ones that stay.

Before downloading anything it resolves the install (`pip install --dry-run --report`,
metadata only) and stops with the figures when the disk has less room than the install
needs. Standard library only: it runs before the virtualenv exists.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The peak of an install into an empty virtualenv with this script (6.55 GB measured),
# with room to spare; and that of an update of a virtualenv that already holds PyTorch.
FULL_INSTALL_GB = 7.0
UPDATE_GB = 1.0


# Packages that carry copies of another package's files, older than the owner's. The
# test extra's xds-protos (Envoy's stubs, for GIE's endpoint picker) has its own copy of
# opentelemetry-proto's modules, without the InstrumentationScope that the OTLP exporter
# imports; whichever of the two pip unpacks last wins, and when it was xds-protos, a
# server with OTEL_EXPORTER_OTLP_ENDPOINT set failed at start. Installed first, on their
# own, they are overwritten by the owners (the Envoy stubs the tests use import none of
# those files).
OVERWRITABLE = ("xds-protos",)


def is_heavy(name: str) -> bool:
    """PyTorch and the packages of its CUDA stack: 100 MB to 900 MB a wheel."""
    name = name.lower().replace("_", "-")
    return name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-"))


def goes_first(name: str) -> bool:
    """Installed on its own before the rest: a heavy package, or an overwritable one."""
    return is_heavy(name) or name.lower().replace("_", "-") in OVERWRITABLE


@dataclass(frozen=True)
class Pin:
    """A package of the resolved install: its name, version and the file pip chose."""

    name: str
    version: str
    url: str


def first_pins(report: dict[str, Any]) -> list[Pin]:
    """The packages that go first (``goes_first``) of those the resolved install (pip's
    JSON report) would add."""
    pins = []
    for item in report.get("install", []):
        meta = item["metadata"]
        if goes_first(meta["name"]):
            pins.append(Pin(meta["name"], meta["version"], item["download_info"]["url"]))
    return pins


def shortfall(free_gb: float, need_gb: float) -> str | None:
    if free_gb >= need_gb:
        return None
    return (
        f"{free_gb:.1f} GB free here, the install needs about {need_gb:.1f} GB at its peak "
        "(PyTorch with its CUDA libraries); free some space, or MIN_FREE_GB=0 to try anyway"
    )


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", *args], check=True)


def _resolve(python: Path, install_args: Sequence[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.json"
        _pip(python, "install", "--dry-run", "--quiet", "--report", str(path), *install_args)
        report: dict[str, Any] = json.loads(path.read_text())
        return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", type=Path)
    parser.add_argument(
        "--min-free-gb",
        type=float,
        default=None,
        help=f"refuse below this much free disk (default: {FULL_INSTALL_GB} GB for an install "
        f"that brings PyTorch, else {UPDATE_GB} GB; 0 never refuses)",
    )
    args, install_args = parser.parse_known_args(argv)
    python = args.venv / "bin" / "python"
    if not python.exists():
        # A new virtualenv gets the current pip: the one Python bundles may be older.
        subprocess.run([sys.executable, "-m", "venv", str(args.venv)], check=True)
        _pip(python, "install", "--quiet", "--upgrade", "pip")
    print("resolving the install (metadata only) ...", flush=True)
    pins = first_pins(_resolve(python, install_args))
    need = args.min_free_gb
    if need is None:
        need = FULL_INSTALL_GB if any(is_heavy(pin.name) for pin in pins) else UPDATE_GB
    free = shutil.disk_usage(args.venv).free / 1e9
    problem = shortfall(free, need)
    if problem is not None:
        print(f"make: {problem}", file=sys.stderr)
        return 1
    for i, pin in enumerate(pins, 1):
        print(f"[{i}/{len(pins)}] {pin.name}=={pin.version}", flush=True)
        # By its URL: the index options of the install (--index-url, --find-links, ...)
        # chose it already.
        _pip(python, "install", "--no-deps", "--no-cache-dir", f"{pin.name} @ {pin.url}")
    _pip(python, "install", *install_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
