"""The engine's gRPC API (``engine.proto``): its generated code, how a replica listens
(``listen``), and the one mapping between engine objects and messages (``codec``).

The engine server serves it (``kvserve.server.grpc_service``); the gateway speaks it
(``kvserve.gateway.upstream``). Both convert only through ``codec``.
"""
