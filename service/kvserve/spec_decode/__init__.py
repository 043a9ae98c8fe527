"""Speculative decoding: draft proposers and the metrics of their acceptance."""
