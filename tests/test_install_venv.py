"""scripts/install_venv.py, the installer behind `make install`, run for real on wheels
made here: the install goes through uv, the owner of a file that another package copies
keeps it, pip's index settings reach uv, and a disk without the room refuses before
anything is installed. No network: the new virtualenv gets this environment's uv (a
single binary), and uv reads only the local folder of wheels, with a cache of its own."""

from __future__ import annotations

import importlib.util
import shutil
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
    _wheel(folder, "small-dep")
    # xds-protos carries an older copy of one of opentelemetry-proto's modules. Here it
    # needs opentelemetry-proto, so that an install in dependency order unpacks it last
    # (the order that broke the real virtualenv).
    shared = "opentelemetry/proto/common.py"
    _wheel(folder, "opentelemetry-proto", extra={shared: "OWNER = 'opentelemetry-proto'\n"})
    _wheel(folder, "xds-protos", ("opentelemetry-proto",), extra={shared: "OWNER = 'xds-protos'\n"})
    _wheel(folder, "app", ("small-dep", "opentelemetry-proto", "xds-protos"))
    return folder


def _venv(path: Path) -> Path:
    """A new virtualenv with this environment's uv in it, as the installer would put it."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    assert uv is not None, "the test extra installs uv beside this Python"
    shutil.copy2(uv, path / "bin" / "uv")
    return path


def _install(
    venv: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(venv), *args, "--no-index", "app"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={
            "PATH": "/usr/bin:/bin",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "UV_CACHE_DIR": str(venv.parent / "uv-cache"),
            **(env or {}),
        },
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
    """One install of ``app`` into a new virtualenv, which the next two tests read. The
    folder of wheels reaches uv as pip's setting (PIP_FIND_LINKS), not as an argument."""
    venv = _venv(tmp_path_factory.mktemp("installed") / "venv")
    proc = _install(venv, "--min-free-gb", "0", env={"PIP_FIND_LINKS": str(wheels)})
    return venv, proc


def test_pips_index_settings_reach_uv(
    installed: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    venv, proc = installed
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {"app", "small-dep", "opentelemetry-proto", "xds-protos"} <= _installed(venv)


def test_the_owner_of_a_shared_file_keeps_it(
    installed: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    venv, proc = installed
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "opentelemetry-proto again, over xds-protos's copies" in proc.stdout
    [shared] = venv.glob("lib/python*/site-packages/opentelemetry/proto/common.py")
    assert shared.read_text() == "OWNER = 'opentelemetry-proto'\n"


def test_a_short_disk_refuses_before_installing(wheels: Path, tmp_path: Path) -> None:
    venv = _venv(tmp_path / "venv")
    proc = _install(venv, "--min-free-gb", "1e9", "--find-links", str(wheels))
    assert proc.returncode == 1
    assert "GB free here, the install needs about 1000000000.0 GB" in proc.stderr
    assert "MIN_FREE_GB=0" in proc.stderr
    assert not {"app", "small-dep"} & _installed(venv)


def test_pips_settings_become_uvs_variables() -> None:
    spec = importlib.util.spec_from_file_location("install_venv", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    config = (
        "global.index-url='https://files.example/simple'\n"
        ":env:.index-url='https://env.example/simple'\n"
        "install.find-links='/wheels/a\\n/wheels/b'\n"
        "global.cert='/etc/pip-ca.pem'\n"
        "global.timeout='60'\n"
        "global.extra-index-url=not a repr\n"  # not pip's format: passed over
    )
    # pip's environment variables win over its files, in either order of the listing;
    # a variable of uv's own that is set wins over both.
    for listing in (config, "\n".join(reversed(config.splitlines()))):
        env = script.uv_environment(listing, {"SSL_CERT_FILE": "/etc/mine.pem"})
        assert env == {
            "SSL_CERT_FILE": "/etc/mine.pem",
            "UV_INDEX_URL": "https://env.example/simple",
            "UV_FIND_LINKS": "/wheels/a /wheels/b",
        }
