"""The per-pod engine server: OpenAI-compatible HTTP/SSE API, health and metrics."""
