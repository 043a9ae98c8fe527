"""Benchmarks: ``kvserve bench ...``, a small harness and one module per section or command
(docs/bench-methods.md says what each measures; sections use only public names)."""
