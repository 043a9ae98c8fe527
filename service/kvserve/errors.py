"""Errors the engine raises for bad input, naming the offending parameter."""

from __future__ import annotations

# OpenAI's error code for a prompt and output limit longer than the model's context:
# clients and agent frameworks key on it to shorten a conversation and retry.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class InvalidRequestError(ValueError):
    """A request that can never be served as given; ``param`` names what to change, and
    ``code`` is OpenAI's error code where it has one for the case."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
