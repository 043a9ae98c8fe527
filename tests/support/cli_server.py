"""``kvserve serve`` as a real process (the command users run)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx

from tests.support.net import free_port
from tests.support.processes import LoggedProcess, start_logged
from tests.support.waiting import wait_until


def start_cli_server(
    model: Path | None,
    *extra: str,
    grpc: bool = False,
    new_session: bool = False,
    env: Mapping[str, str] | None = None,
) -> tuple[LoggedProcess, str, int]:
    """``kvserve serve`` on a free port, once it reports ready; its output is in ``.log``.

    ``model=None`` runs it with no model arguments at all (the bundled demo model).
    ``grpc`` serves the gRPC API too, on another free port. ``new_session``: in a process
    group of its own, which a test may signal as a whole (as a terminal's Ctrl-C does).
    ``env``: variables set for it, beside this process's own.
    """
    port = free_port()
    args = ["--port", str(port)]
    args += ["--grpc-port", str(free_port())] if grpc else ["--no-grpc"]
    if model is not None:
        args += ["--model", str(model), "--served-model-name", "m", "--dtype", "float32"]
    proc = start_logged(
        [sys.executable, "-m", "kvserve", "serve", *args, *extra, "--log-level", "warning"],
        "kvserve-serve",
        start_new_session=new_session,
        env={**os.environ, **(env or {})},
        # In a session of its own it may be sent SIGINT as a terminal's Ctrl-C is; a suite
        # started in the background (``cmd &``) has SIGINT ignored, which stays ignored
        # across exec: the default disposition back, for it and the workers it starts.
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if new_session else None,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with {proc.poll()}\n{proc.tail()}")
        try:
            return httpx.get(f"{url}/ready").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, timeout=120)
    return proc, url, port


def sigterm_mid_stream(proc: LoggedProcess, url: str, lines: Iterator[str]) -> None:
    """Once a stream (``lines``, its SSE lines) has sent two events: SIGTERM the server,
    then wait until it stops admitting (its drain has begun)."""
    seen = 0
    while seen < 2:
        seen += next(lines).startswith("data: ")
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(f"{url}/ready").status_code == 503)
