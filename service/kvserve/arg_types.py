"""argparse ``type=`` checks the commands share: a bad value is a usage error (exit 2)
that names it, never a traceback."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


def positive_int(text: str) -> int:
    """A whole number ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def number(text: str) -> float:
    """A number (``float``), or the usage error that says it is none."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    value = number(text)
    if not 0 < value < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return value


def non_negative_seconds(text: str) -> float:
    """A finite number of seconds ≥ 0."""
    value = number(text)
    if not 0 <= value < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 seconds or more")
    return value


def http_url(text: str) -> str:
    """An http(s) URL with a host (``http://127.0.0.1:8000``): without a scheme, the
    failure came only later, from deep inside the run."""
    try:
        parts = urlsplit(text)
        _ = parts.port  # raises ValueError for a port that is no number or out of range
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"{text!r}: not an http(s) URL such as http://127.0.0.1:8000"
        )
    return text


def torch_device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (whether CUDA is there is for the command to check:
    that needs torch, which a parser must not import)."""
    if text in ("cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: not a device (cpu, cuda or cuda:N)")


class MinMax(argparse.Action):
    """Two values ``MIN MAX`` (``nargs=2``, each checked by the argument's ``type``), with
    MIN ≤ MAX: a range the other way round was an empty one, a traceback later."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        low, high = list(values or ())  # nargs=2: two values, already typed
        if low > high:
            raise argparse.ArgumentError(self, f"MIN {low} is more than MAX {high}")
        setattr(namespace, self.dest, (low, high))


def output_file(text: str) -> Path:
    """A file to write: not a directory, in a directory that exists. Checked when the
    command starts, not when its results are written at the end."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: there is no directory {str(parent)!r}")
    return path


def output_dir(text: str) -> Path:
    """A directory to write into, made if it is missing: not an existing file, and not
    under one."""
    path = Path(text)
    # The path itself, or else the nearest of its parents that exists ("/" at the least).
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if existing.is_dir():
        return path
    if existing == path:
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a directory")
    raise argparse.ArgumentTypeError(f"{text!r} is under {str(existing)!r}, a file")
