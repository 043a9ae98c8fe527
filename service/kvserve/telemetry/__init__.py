"""Request telemetry: the fixed latency and goodput definitions."""
