"""Loopback ports for the servers tests start."""

from __future__ import annotations

import socket
import threading

_lock = threading.Lock()
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on now, and never one this process handed out
    before: two picks in a row (a replica's HTTP and gRPC ports) could otherwise get the
    same port back from the kernel, once the first probe socket is closed, and the
    second server then fails to bind."""
    with _lock:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port
