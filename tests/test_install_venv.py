"""scripts/install_venv.py, the installer behind `make install`, run for real on wheels
made here: a package that needs a "heavy" one (named like PyTorch's CUDA libraries) is
installed with the heavy one first, on its own; a disk without the room refuses before
anything is installed. No network: the virtualenv is made here with its bundled pip, and
pip reads only the local folder of wheels."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install_venv.py"
WHEEL_INFO = (
    "Wheel-Version: 1.0\nGenerator: kvserve-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
)


def _wheel(
    folder: Path, name: str, requires: tuple[str, ...] = (), extra: dict[str, str] | None = None
) -> None:
    """A wheel of package ``name`` (module ``name`` with dashes as underscores), also
    holding the files ``extra`` (path → text)."""
    module = name.replace("-", "_")
    info = f"{module}-1.0.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    files = {
        f"{module}/__init__.py": f"NAME = {name!r}\n",
        **(extra or {}),
        f"{info}/METADATA": metadata,
        f"{info}/WHEEL": WHEEL_INFO,
    }
    record = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{module}-1.0-py3-none-any.whl", "w") as wheel:
        for path, text in {**files, f"{info}/RECORD": record}.items():
            wheel.writestr(path, text)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    _wheel(folder, "nvidia-fake-blas")
    _wheel(folder, "small-dep")
    # xds-protos carries an older copy of one of opentelemetry-proto's modules. Here it
    # needs opentelemetry-proto, so that a plain install unpacks it last (the order that
    # broke the real virtualenv).
    shared = "opentelemetry/proto/common.py"
    _wheel(folder, "opentelemetry-proto", extra={shared: "OWNER = 'opentelemetry-proto'\n"})
    _wheel(folder, "xds-protos", ("opentelemetry-proto",), extra={shared: "OWNER = 'xds-protos'\n"})
    _wheel(folder, "app", ("nvidia-fake-blas", "small-dep", "opentelemetry-proto", "xds-protos"))
    return folder


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    path = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    return path


def _install(venv: Path, wheels: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    args = [str(venv), *flags, "--no-index", "--find-links", str(wheels), "app"]
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )


def _installed(venv: Path) -> set[str]:
    listed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "freeze"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return {line.split("==")[0] for line in listed.stdout.split()}


@pytest.fixture(scope="module")
def installed(
    wheels: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One install of ``app`` into a new virtualenv, which the next two tests read."""
    path = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    return path, _install(path, wheels, "--min-free-gb", "0")


def test_heavy_packages_go_first_one_at_a_time(
    installed: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    venv, proc = installed
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert steps == ["[1/2] nvidia-fake-blas==1.0", "[2/2] xds-protos==1.0"], proc.stdout
    assert {"app", "nvidia-fake-blas", "small-dep"} <= _installed(venv)


def test_the_owner_of_a_shared_file_keeps_it(
    installed: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    venv, proc = installed
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [shared] = venv.glob("lib/python*/site-packages/opentelemetry/proto/common.py")
    assert shared.read_text() == "OWNER = 'opentelemetry-proto'\n"


def test_a_short_disk_refuses_before_installing(venv: Path, wheels: Path) -> None:
    proc = _install(venv, wheels, "--min-free-gb", "1e9")
    assert proc.returncode == 1
    assert "GB free here, the install needs about 1000000000.0 GB" in proc.stderr
    assert "MIN_FREE_GB=0" in proc.stderr
    assert not {"app", "nvidia-fake-blas", "small-dep"} & _installed(venv)
