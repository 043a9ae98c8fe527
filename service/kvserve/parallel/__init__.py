"""Tensor parallelism: how a model is split over ranks, and the ranks' processes."""
