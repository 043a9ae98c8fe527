"""Port numbers given on the command line."""

from __future__ import annotations

import argparse
import socket


def port_number(text: str) -> int:
    """argparse type: a TCP port, 1-65535. (A larger number is not refused by the socket
    layer underneath: 70000 would bind port 4464 and be reported as 70000.)"""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` now (something listens there
    already, or ``host`` is no address of this machine), or None. Checked before a slow
    start, such as loading a model, so that a taken port fails in a second with one
    line; the server's own bind still decides."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            # As the servers bind: an old connection in TIME_WAIT does not block the port.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None
