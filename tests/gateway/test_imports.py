"""The gateway's app does not load torch: a gateway process needs none of the engine."""

from __future__ import annotations

import subprocess
import sys


def test_the_gateway_app_imports_without_torch() -> None:
    code = (
        "import sys, kvserve.gateway.app\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
