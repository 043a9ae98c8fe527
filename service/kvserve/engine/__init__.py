"""The step-level engine: request state, KV block pool, scheduler, model runner."""
