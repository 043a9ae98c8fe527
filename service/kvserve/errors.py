"""Errors the engine raises for bad input, naming the offending parameter."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that can never be served as given; ``param`` names what to change."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
