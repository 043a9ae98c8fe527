"""The bundled demo model as a ``file://`` source that an engine pod can pull.

The operator refuses a ``file://`` model under ``/tmp``: a pod mounts its own ``/tmp``
volume over it (docs/inference-model.md). A checkout may itself live under ``/tmp`` (a
fresh clone in CI), so the tests pull from a copy in the kvserve cache instead, made
once per content of the checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

from kvserve.demo_model import DEMO_MODEL_DIR


@functools.cache  # (hashing the checkpoint once per test process)
def demo_model_source() -> str:
    """``file://`` + a directory outside ``/tmp`` holding the demo model."""
    # By content: a retrained checkpoint can keep every file's size.
    digest = hashlib.sha256()
    for p in sorted(p for p in DEMO_MODEL_DIR.iterdir() if p.is_file()):
        digest.update(f"{p.name} {hashlib.sha256(p.read_bytes()).hexdigest()}\n".encode())
    key = digest.hexdigest()[:12]
    cache = Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve"))
    dest = cache / "test-demo-model" / key
    if not dest.is_dir():
        stage = dest.with_name(f"{key}.tmp{os.getpid()}")
        shutil.rmtree(stage, ignore_errors=True)
        shutil.copytree(DEMO_MODEL_DIR, stage, ignore=shutil.ignore_patterns("__pycache__"))
        try:
            stage.rename(dest)  # atomic: a concurrent session may have won the race
        except OSError:
            shutil.rmtree(stage, ignore_errors=True)
    return f"file://{dest}"
