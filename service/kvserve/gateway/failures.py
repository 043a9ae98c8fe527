"""What a request that failed upstream means, and what its client gets.

Three causes, told apart by where the error came from (``kvserve.gateway.multiplex``):

- the request's own: the engine refused it as invalid (400, naming its parameter), or
  failed it alone (500). Never retried, as it would fail alike elsewhere, and the replica
  stays in rotation: a client that can make its own request fail must not take a replica
  from everyone else.
- the replica's: its call broke, or it answered UNAVAILABLE (draining, its engine dead).
  Retried on another replica while no output was sent (502 after that, or when no
  replica could serve it), and the replica is unhealthy until a load poll answers.
- the clock's: ``request_timeout_seconds`` passed since the request arrived (504
  ``timeout``); the gateway's own deadline, which says nothing of the replica.
"""

from __future__ import annotations

import grpc

from kvserve.gateway.multiplex import ReplicaAnswered
from kvserve.openai.errors import OpenAIError
from kvserve.rpc import codec

# Engine refusals that mean "this request is bad", not "this replica is bad".
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


def refused(exc: grpc.aio.AioRpcError) -> OpenAIError | None:
    """The 400 of a request the engine refused as invalid, with the parameter and the
    OpenAI code it named; None for any other failure."""
    if exc.code() not in CLIENT_ERRORS:
        return None
    param, code = codec.error_fields(exc.trailing_metadata())
    return OpenAIError(400, exc.details(), param=param, code=code)


def replica_broken(exc: grpc.aio.AioRpcError) -> bool:
    """Whether ``exc`` says the replica, not the request or the clock, failed."""
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return False
    return not isinstance(exc, ReplicaAnswered) or exc.code() == grpc.StatusCode.UNAVAILABLE


def client_error(exc: grpc.aio.AioRpcError, timeout: float) -> OpenAIError:
    """The client's error for a request that failed upstream and was not refused as
    invalid: 504 when its ``timeout`` (seconds) ran out, 500 when the replica failed
    this request alone, 502 when the replica itself failed."""
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the gateway's own timer
        return timed_out(timeout)
    if not replica_broken(exc):
        return OpenAIError(500, f"the replica failed on this request: {exc.details()}")
    return OpenAIError(502, f"the replica failed: {exc.details()}")


def timed_out(timeout: float) -> OpenAIError:
    return OpenAIError(
        504,
        f"the request did not finish within the gateway's request timeout ({timeout:g} s)",
        code="timeout",
    )
