"""The servers' logs: one ``--log-level`` flag (uvicorn's levels) and one line format."""

from __future__ import annotations

import argparse
import logging

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
TRACE = 5  # uvicorn's level below DEBUG, which logging has no name for


def add_log_level_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default="info",
        help="log level, also uvicorn's (default: info)",
    )


def configure_logging(level: str) -> None:
    """The root logger at ``level`` (one of ``LOG_LEVELS``)."""
    logging.basicConfig(
        level=TRACE if level == "trace" else level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
