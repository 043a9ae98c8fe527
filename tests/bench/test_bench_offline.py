"""``kvserve bench offline``'s arguments, checked before any checkpoint is built."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.fresh_python import heavy_modules_after

BAD_ARGUMENTS = [
    (["--num-prompts", "0"], "argument --num-prompts: '0': must be at least 1"),
    (["--num-prompts", "-3"], "argument --num-prompts: '-3': must be at least 1"),
    (["--rounds", "0"], "argument --rounds: '0': must be at least 1"),
    (["--prompt-len", "0", "10"], "argument --prompt-len: '0': must be at least 1"),
    (["--prompt-len", "20", "10"], "argument --prompt-len: MIN 20 is more than MAX 10"),
    (["--output-len", "9", "3"], "argument --output-len: MIN 9 is more than MAX 3"),
    (["--output-len", "0", "5"], "argument --output-len: '0': must be at least 1"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1 and <= 4096, got 0"),
    (["--max-num-seqs", "5000"], "argument --max-num-seqs: must be >= 1 and <= 4096, got 5000"),
    (["--device", "gpu0"], "argument --device: 'gpu0': not a device (cpu, cuda or cuda:N)"),
    (
        ["--prompt-len", "1000", "2000", "--output-len", "100", "200"],
        "--prompt-len MAX + --output-len MAX is 2200 tokens, more than the benchmark "
        "model's 2048 positions",
    ),
]


@pytest.mark.parametrize(
    ("args", "expected"), BAD_ARGUMENTS, ids=[" ".join(args) for args, _ in BAD_ARGUMENTS]
)
def test_a_bad_value_is_one_error_line(args: list[str], expected: str) -> None:
    """Each was a traceback (an empty range, an empty max(), the engine's config check) or,
    for a prompt of 0 tokens, accepted; most came after building the checkpoint."""
    argv = [sys.executable, "-m", "kvserve", "bench", "offline", "--model-size", "tiny", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"kvserve bench offline: error: {expected}", proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_value_is_refused_before_torch_loads() -> None:
    code = (
        "from kvserve.cli import main\n"
        "try:\n    rc = main(['bench', 'offline', '--prompt-len', '20', '10'])\n"
        "except SystemExit as exit:\n    rc = exit.code\n"
        "assert rc == 2, rc"
    )
    assert heavy_modules_after(code, {"torch", "transformers"}) == set()
