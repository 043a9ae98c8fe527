"""The engine's gRPC streaming API (``engine.proto``), spoken by the gateway."""
