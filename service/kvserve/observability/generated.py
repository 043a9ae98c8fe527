"""Keeping generated files in the repository in step with their generator."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path


def sync_files(files: Mapping[Path, str], root: Path, *, check: bool, regenerate: str) -> bool:
    """Write the files whose text changed, or with ``check`` only report the stale ones.

    Returns False when ``check`` finds a stale file (``regenerate`` is the command that
    fixes it, shown to the reader).
    """
    stale = [p for p, text in files.items() if not p.exists() or p.read_text("utf-8") != text]
    if check:
        if stale:
            print(f"stale generated files (run: {regenerate}):", file=sys.stderr)
            for path in stale:
                print(f"  - {path.relative_to(root)}", file=sys.stderr)
        return not stale
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[path], encoding="utf-8")
        print(f"wrote {path.relative_to(root)}")
    return True
