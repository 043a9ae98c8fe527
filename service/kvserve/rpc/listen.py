"""How a replica's gRPC server listens: its channel options and binding its port.

Kept apart from ``service`` (which loads the engine and torch) so that a stand-in replica
(``kvserve.bench.stub_replica``) listens exactly as a real one does.
"""

from __future__ import annotations

import grpc

# The gateway pings each replica every 30 s (kvserve.gateway.upstream) to notice a dead
# one, also while its GenerateMany call is idle. gRPC's default refuses pings without data
# more often than every 5 minutes and answers them with GOAWAY "too_many_pings", which
# would end that call (and any request waiting on it) after about 90 idle seconds.
MIN_PING_INTERVAL_MS = 10_000

# The largest gRPC message either side takes (gRPC's default is 4 MiB). The gateway packs
# many requests' commands into one GenerateMany message, each sample of an n > 1 request
# carrying the whole request, so it splits what it sends into messages of at most
# kvserve.gateway.multiplex.BATCH_BYTES; one request's start alone stays far below this
# (the gateway's max_body_bytes is at most half of it).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def server_options(min_ping_interval_ms: int = MIN_PING_INTERVAL_MS) -> list[tuple[str, int]]:
    """Channel arguments of the replica's gRPC server: accept the gateway's keepalive and
    messages up to MAX_MESSAGE_BYTES, and own the port alone."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_interval_ms),
        # gRPC sets SO_REUSEPORT by default: a second replica started on a taken port
        # would bind it too and silently take half the connections. Fail instead.
        ("grpc.so_reuseport", 0),
    ]


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Listen on ``host:port`` (``port=0``: a free one); the bound port. OSError naming
    the address when it cannot be bound."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound: int = server.add_insecure_port(address)
    except RuntimeError:  # what grpcio raises when the bind fails (older versions: 0)
        bound = 0
    if bound == 0:
        raise OSError(f"could not bind the gRPC server to {address} (is the port in use?)")
    return bound
