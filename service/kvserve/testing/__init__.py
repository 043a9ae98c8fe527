"""Offline test helpers (tiny tokenizers etc.) for tests, demos and benchmarks."""
