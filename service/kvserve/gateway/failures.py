"""What a request that failed upstream means, and what its client gets; and the 503s
of a request that could not go upstream at all (``queue_refusal``,
``no_healthy_replica``).

Four causes, told apart by where the error came from (``kvserve.gateway.multiplex``):

- the request's own: the engine refused it as invalid (400, naming its parameter), or
  failed it alone (500). Never retried, as it would fail alike elsewhere, and the replica
  stays in rotation: a client that can make its own request fail must not take a replica
  from everyone else.
- the adapter's: the replica does not serve the request's LoRA adapter now (unloaded, or
  its files can no longer be read there: ``adapter_gone``). Retried on another replica,
  which the gateway may have load the adapter; the replica stays in rotation.
- the replica's: its call broke, it answered UNAVAILABLE (draining, its engine dead), or
  a load poll failed while the request had no output from it yet
  (``kvserve.gateway.replicas``: a replica that keeps its connection open but answers
  nothing would otherwise hold the request until its deadline). Retried on another
  replica while no output was sent (502 after that, or when no replica could serve it),
  and the replica is unhealthy until a load poll answers.
- the clock's: ``request_timeout_seconds`` passed since the request arrived (504
  ``timeout``); the gateway's own deadline, which says nothing of the replica.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import grpc

from kvserve.gateway.admission import AdmissionRejected
from kvserve.gateway.multiplex import ReplicaAnswered
from kvserve.gateway.routing import ReplicaLoad
from kvserve.lora.request import ADAPTER_UNAVAILABLE
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


def adapter_gone(exc: grpc.aio.AioRpcError) -> bool:
    """Whether ``exc`` says the replica does not serve the request's LoRA adapter now:
    unloaded since the last poll (NOT_FOUND), or its files can no longer be read there
    (UNAVAILABLE, ``adapter_unavailable``). The replica serves on: another one may serve
    the adapter."""
    if exc.code() == grpc.StatusCode.NOT_FOUND:
        return True
    _, code = codec.error_fields(exc.trailing_metadata())
    return exc.code() == grpc.StatusCode.UNAVAILABLE and code == ADAPTER_UNAVAILABLE


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


def queue_refusal(exc: AdmissionRejected) -> OpenAIError:
    """The 503 of a request the admission queue refused (full, shed, or timed out); its
    ``code`` is the rejection metric's reason."""
    reason = "queue_timeout" if exc.reason == "timeout" else "queue_full"
    return OpenAIError(503, str(exc), code=reason, headers={"retry-after": str(exc.retry_after)})


def no_healthy_replica(
    model: str,
    views: Sequence[ReplicaLoad],
    exclude: Collection[str],
    last_error: str,
    poll_seconds: float,
) -> OpenAIError:
    """The 503 of a request no replica of ``model`` can take now (each unhealthy,
    draining, or in ``exclude``: tried before, ``last_error`` saying why it failed)."""
    counts: dict[str, int] = {}
    for view in views:
        if view.draining:
            state = "draining"
        elif not view.healthy:
            state = "unhealthy"
        else:  # routable, so excluded: this request failed there before
            state = "already tried"
        counts[state] = counts.get(state, 0) + 1
    why = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none known"
    return OpenAIError(
        503,
        f"no healthy replica of {model!r} can take the request now ({why}"
        + (f"; {last_error})" if last_error else ")"),
        code="no_healthy_replica",
        # The next load poll is the earliest the gateway can see a replica come back.
        headers={"retry-after": str(max(1, math.ceil(poll_seconds)))},
    )
