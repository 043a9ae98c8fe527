"""Create the virtualenv and install kvserve into it with uv.

    python3 scripts/install_venv.py VENV [--min-free-gb GB] INSTALL_ARGS...

`make install` (and so `make run` and `make test`) runs this. The installer is uv (PyPI:
`uv`, installed into the virtualenv with its own pip): it downloads in parallel, unpacks
each wheel once into its cache (`~/.cache/uv`, or `UV_CACHE_DIR`) and hard-links the
virtualenv's files to it. PyTorch's Linux wheel brings its CUDA libraries (a 6.3 GB
virtualenv), so this matters. Measured on 2026-12-07 on the 2-core test machine, a new
virtualenv of `.[test]` with its bytecode compiled: 3 min 12 s through pip (each heavy
wheel on its own, as this script did before), 76 s through uv with an empty cache and 49 s
with a warm one (most of it compiling bytecode). The disk's peak with an empty cache was
6.5 GB, the cache's 5.9 GB and the virtualenv hard-linked to it (pip's scheme: 6.55 GB); on
another filesystem than the cache, the virtualenv is a copy (uv says so).

uv does not read pip's configuration, so the index settings pip would use (`pip config
list`: files and `PIP_*` variables) are passed on as uv's variables, unless those are set.

Before installing anything it stops, with the figures, when the disk has less room than
the install needs: the full install when the virtualenv has no PyTorch yet. Standard
library only: it runs before the virtualenv exists.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

# An install that brings PyTorch: its files in uv's cache (5.9 GB) plus the hard-linked
# virtualenv and its bytecode (6.5 GB measured), with room to spare (a copy, when the
# cache is on another filesystem, needs the same again there); an update of a
# virtualenv that already holds PyTorch.
FULL_INSTALL_GB = 7.0
UPDATE_GB = 1.0

# Packages that carry copies of another package's files, older than the owner's, and
# that owner. The test extra's xds-protos (Envoy's stubs, for GIE's endpoint picker) has
# its own copy of opentelemetry-proto's modules, without the InstrumentationScope that
# the OTLP exporter imports; whichever of the two is unpacked last wins, and when it was
# xds-protos, a server with OTEL_EXPORTER_OTLP_ENDPOINT set failed at start. uv unpacks
# in parallel, so after the install the owner is installed again, on its own (the Envoy
# stubs the tests use import none of those files).
OVERWRITTEN_BY = {"xds-protos": "opentelemetry-proto"}

# pip's settings (as `pip config list` names them) and the variables uv reads instead.
PIP_TO_UV = {
    "index-url": "UV_INDEX_URL",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "find-links": "UV_FIND_LINKS",
    "cert": "SSL_CERT_FILE",
}


def shortfall(free_gb: float, need_gb: float) -> str | None:
    if free_gb >= need_gb:
        return None
    return (
        f"{free_gb:.1f} GB free here, the install needs about {need_gb:.1f} GB at its peak "
        "(PyTorch with its CUDA libraries); free some space, or MIN_FREE_GB=0 to try anyway"
    )


def uv_environment(pip_config: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` plus uv's variables for the index settings in ``pip_config`` (the
    output of `pip config list`, lines like ``global.index-url='https://…'``); a
    variable already set wins, and pip's environment variables (``:env:``) win over its
    files, as in pip."""
    found: dict[str, tuple[bool, str]] = {}
    for line in pip_config.splitlines():
        name, sep, quoted = line.partition("=")
        section, _, key = name.rpartition(".")
        if not sep or key not in PIP_TO_UV:
            continue
        from_env = section == ":env:"
        if key in found and found[key][0] and not from_env:
            continue
        try:
            value = ast.literal_eval(quoted)  # pip prints each value's repr()
        except (ValueError, SyntaxError):
            continue
        found[key] = (from_env, " ".join(str(value).split()))
    env = dict(environ)
    for key, (_, value) in found.items():
        env.setdefault(PIP_TO_UV[key], value)
    return env


def _has(venv: Path, package: str) -> bool:
    """Whether ``package`` is installed in ``venv``."""
    name = package.lower().replace("-", "_")
    for info in venv.glob("lib/python*/site-packages/*.dist-info"):
        if info.name.lower().partition("-")[0] == name:
            return True
    return False


def _run(*args: str | Path, env: Mapping[str, str] | None = None) -> None:
    subprocess.run([str(a) for a in args], check=True, env=env)


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
        _run(sys.executable, "-m", "venv", args.venv)
    need = args.min_free_gb
    if need is None:
        need = UPDATE_GB if _has(args.venv, "torch") else FULL_INSTALL_GB
    problem = shortfall(shutil.disk_usage(args.venv).free / 1e9, need)
    if problem is not None:
        print(f"make: {problem}", file=sys.stderr)
        return 1
    uv = args.venv / "bin" / "uv"
    if not uv.exists():
        print("installing uv, the installer, with pip ...", flush=True)
        _run(python, "-m", "pip", "install", "--quiet", "uv")
    pip_config = subprocess.run(
        [str(python), "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    env = uv_environment(pip_config, os.environ)
    # Bytecode at install, as pip does: uv leaves it to the first import by default, and
    # where PYTHONDONTWRITEBYTECODE is set, every process would compile PyTorch anew.
    uv_install = (uv, "pip", "install", "--compile-bytecode", "--python", python)
    _run(*uv_install, *install_args, env=env)
    for overwritable, owner in OVERWRITTEN_BY.items():
        if _has(args.venv, overwritable):
            print(f"{owner} again, over {overwritable}'s copies of its files", flush=True)
            reinstall = ("--reinstall-package", owner, "--quiet")
            _run(*uv_install, *reinstall, *install_args, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
