"""argparse ``type=`` checks the commands share: a bad value is a usage error (exit 2)
that names it, never a traceback."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """A whole number ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not 0 < value < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return value
