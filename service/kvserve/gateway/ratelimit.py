"""Per-tenant rate limits: requests per minute, tokens per minute, concurrent requests.

Both per-minute limits are token buckets (not GCRA): capacity = the per-minute limit,
refilled continuously at limit/60 per second, starting full. A tenant can therefore burst
up to a minute's allowance at once, then continues at the sustained rate.

- Requests: each admission takes 1 from the request bucket.
- Tokens: each admission *reserves* its worst case (``prompt_tokens + max_tokens``) from
  the token bucket; ``Admission.finish(actual_tokens)`` settles to the real usage,
  refunding the unused part or charging the excess. An overrun beyond what is left is
  carried as debt (the level goes below 0), which delays the tenant's next requests
  until the refill has paid it, so over any window a tenant uses at most its limit plus
  what its requests in flight overran. A
  reservation larger than the whole bucket could never be admitted, so it raises
  ``RequestTooLarge`` (not ``RateLimited``): retrying cannot help. The gateway may answer
  it 400 (rejection reason ``invalid``) or, like OpenAI, 429 without ``Retry-After``
  (reason ``rate_limited_tokens``); both exceptions share the base ``LimitExceeded``.
- Concurrency: a counter of sequences (a request's choices, prompts × n: each is an
  engine request), taken at admission and given back by ``finish``; a request with more
  sequences than the limit raises ``TooManySequences``.

Admission is all or nothing: every limit is checked before anything is taken, so a
rejected request consumes nothing. A tenant with no limit configured is not limited by
it, and its ``x-ratelimit-*`` headers are left out.

The buckets and the ``x-ratelimit-*`` headers they answer with are in
``kvserve.gateway.token_bucket``.

The gateway calls this from its one asyncio loop and nothing here awaits, so there are
no locks. Time comes from the injected ``clock`` (``time.monotonic`` by default).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from kvserve.gateway.auth import Tenant
from kvserve.gateway.keys import KeyLimits
from kvserve.gateway.token_bucket import TokenBucket, format_duration, retry_after_header

Reason = Literal["rate_limited_requests", "rate_limited_tokens", "concurrency"]

CONCURRENCY_RETRY_SECONDS = 1.0  # when a slot frees is unknowable; suggest a short wait


@dataclass
class _TenantState:
    """One tenant's usage; a missing bucket (None) is an unlimited dimension."""

    limits: KeyLimits
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0

    def refill(self, now: float) -> None:
        for bucket in (self.requests, self.tokens):
            if bucket is not None:
                bucket.refill(now)

    def apply(self, limits: KeyLimits, now: float) -> None:
        """Hot reload: new limits, keeping current usage."""
        self.refill(now)
        self.requests = _resized(self.requests, limits.requests_per_minute, now)
        self.tokens = _resized(self.tokens, limits.tokens_per_minute, now)
        self.limits = limits

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.requests is not None:
            out |= self.requests.headers("requests")
        if self.tokens is not None:
            out |= self.tokens.headers("tokens")
        return out


def _resized(bucket: TokenBucket | None, capacity: int | None, now: float) -> TokenBucket | None:
    if capacity is None:
        return None
    if bucket is None:  # a newly limited dimension starts full
        return TokenBucket(capacity, float(capacity), now)
    bucket.resize(capacity)
    return bucket


class LimitExceeded(Exception):
    """A request refused by a per-tenant limit: base of ``RateLimited`` and
    ``RequestTooLarge``. ``headers`` are the ``x-ratelimit-*`` (and ``retry-after``)."""

    def __init__(self, reason: Reason, message: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.reason: Reason = reason
        self.message = message
        self.headers = headers
        self.code = "rate_limit_exceeded"


class RateLimited(LimitExceeded):
    """Over a limit now but not forever: answer 429 with ``headers`` (incl. retry-after).

    ``reason`` names the limit that forces the longest wait; ``retry_after_seconds`` is
    that wait (exact; the header rounds it up to whole seconds, at least 1).
    """

    def __init__(
        self,
        reason: Reason,
        retry_after_seconds: float,
        headers: dict[str, str],
        message: str = "",
    ) -> None:
        super().__init__(reason, message or f"rate limit reached ({reason})", headers)
        self.retry_after_seconds = retry_after_seconds


class TooManySequences(LimitExceeded):
    """The request runs more sequences (prompts × n) than the tenant may have in flight,
    so it could never be admitted; no ``retry-after``."""

    def __init__(self, requested: int, limit: int, headers: dict[str, str]) -> None:
        super().__init__(
            "concurrency",
            f"request runs {requested} sequences (prompts × n) but the limit is {limit} "
            "concurrent; lower n or send fewer prompts",
            headers,
        )


class RequestTooLarge(LimitExceeded):
    """The token reservation exceeds the tenant's whole tokens-per-minute limit, so it
    could never be admitted; no ``retry-after``. Lower ``max_tokens`` or raise the limit."""

    def __init__(self, requested: int, limit: int, headers: dict[str, str]) -> None:
        super().__init__(
            "rate_limited_tokens",
            f"request needs {requested} tokens (prompt + max_tokens) but the limit is "
            f"{limit} tokens per minute; lower max_tokens or shorten the prompt",
            headers,
        )
        self.requested, self.limit = requested, limit


class Admission:
    """What an admitted request holds: one request, a token reservation, and a concurrency
    slot per sequence it runs (its choices: prompts × n).

    ``finish(actual_tokens)`` settles the reservation and frees the slot, exactly once.
    """

    def __init__(
        self,
        tenant: str,
        reserved_tokens: int,
        headers: dict[str, str],
        state: _TenantState,
        tokens: TokenBucket | None,
        clock: Callable[[], float],
        sequences: int = 1,
    ) -> None:
        self.tenant = tenant
        self.reserved_tokens = reserved_tokens
        self.sequences = sequences
        self.headers = headers  # for the successful response
        self._state = state
        self._tokens = tokens  # the bucket reserved from (survives a limits reload)
        self._clock = clock
        self.finished = False

    def finish(self, actual_tokens: int) -> bool:
        """Settles to ``actual_tokens`` (prompt + completion actually processed) and frees
        the concurrency slot. Idempotent: only the first call counts (returns True)."""
        if actual_tokens < 0:
            raise ValueError(f"actual_tokens must be >= 0, got {actual_tokens}")
        if self.finished:
            return False
        self.finished = True
        self._state.in_flight -= self.sequences
        if self._tokens is not None:
            self._tokens.refill(self._clock())
            difference = self.reserved_tokens - actual_tokens
            if difference > 0:
                self._tokens.give(difference)
            else:
                self._tokens.charge(-difference)
        return True

    def __repr__(self) -> str:
        return (
            f"Admission(tenant={self.tenant!r}, reserved_tokens={self.reserved_tokens}, "
            f"finished={self.finished})"
        )


@dataclass(frozen=True)
class Usage:
    """A tenant's state right now (for metrics and tests); None fields are unlimited."""

    requests_available: float | None
    tokens_available: float | None
    in_flight: int


class RateLimiter:
    """Per-tenant limits, keyed by tenant name. See the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[str, _TenantState] = {}

    def _state(self, tenant: Tenant, now: float) -> _TenantState:
        state = self._states.get(tenant.name)
        if state is None:
            limits = tenant.limits
            state = _TenantState(
                limits,
                _resized(None, limits.requests_per_minute, now),
                _resized(None, limits.tokens_per_minute, now),
            )
            self._states[tenant.name] = state
        elif state.limits != tenant.limits:
            state.apply(tenant.limits, now)
        state.refill(now)
        return state

    def admit(self, tenant: Tenant, estimated_tokens: int, sequences: int = 1) -> Admission:
        """Admits one request reserving ``estimated_tokens`` (prompt + max_tokens) that
        runs ``sequences`` engine requests (its choices), or raises ``RateLimited`` /
        ``RequestTooLarge`` / ``TooManySequences`` having taken nothing. Each sequence
        holds a concurrency slot: what the limit protects is the replicas' work."""
        if estimated_tokens < 0:
            raise ValueError(f"estimated_tokens must be >= 0, got {estimated_tokens}")
        now = self._clock()
        state = self._state(tenant, now)
        limits = state.limits
        if state.tokens is not None and estimated_tokens > state.tokens.capacity:
            raise RequestTooLarge(estimated_tokens, state.tokens.capacity, state.headers())
        if limits.max_concurrent is not None and sequences > limits.max_concurrent:
            raise TooManySequences(sequences, limits.max_concurrent, state.headers())

        waits: list[tuple[float, Reason, str]] = []
        if state.requests is not None and not state.requests.has(1):
            waits.append(
                (
                    state.requests.wait_for(1),
                    "rate_limited_requests",
                    f"{limits.requests_per_minute} requests per minute",
                )
            )
        if state.tokens is not None and not state.tokens.has(estimated_tokens):
            waits.append(
                (
                    state.tokens.wait_for(estimated_tokens),
                    "rate_limited_tokens",
                    f"{limits.tokens_per_minute} tokens per minute "
                    f"(this request reserves {estimated_tokens})",
                )
            )
        if (
            limits.max_concurrent is not None
            and state.in_flight + sequences > limits.max_concurrent
        ):
            waits.append(
                (
                    CONCURRENCY_RETRY_SECONDS,
                    "concurrency",
                    f"{limits.max_concurrent} concurrent requests",
                )
            )
        if waits:
            # The longest wait decides: retrying after a shorter one would fail again.
            wait, reason, what = max(waits, key=lambda w: w[0])
            headers = state.headers() | {"retry-after": retry_after_header(wait)}
            message = (
                f"rate limit reached for tenant {tenant.name!r}: {what}; "
                f"retry in {format_duration(wait)}"
            )
            raise RateLimited(reason, wait, headers, message)

        if state.requests is not None:
            state.requests.take(1)
        if state.tokens is not None:
            state.tokens.take(estimated_tokens)
        state.in_flight += sequences
        reserved = estimated_tokens if state.tokens is not None else 0
        return Admission(
            tenant.name, reserved, state.headers(), state, state.tokens, self._clock, sequences
        )

    def update(self, tenants: Iterable[Tenant]) -> None:
        """Hot reload: applies new limits now, keeping each remaining tenant's usage.

        Tenants no longer listed are forgotten once they have nothing in flight (their
        in-flight admissions still finish against the state they hold).
        """
        now = self._clock()
        current = {t.name: t for t in tenants}
        for name, state in list(self._states.items()):
            tenant = current.get(name)
            if tenant is None:
                if state.in_flight == 0:
                    del self._states[name]
            elif state.limits != tenant.limits:
                state.apply(tenant.limits, now)

    def usage(self, tenant_name: str) -> Usage | None:
        """The tenant's state now, or None if it has none (never seen, or forgotten)."""
        state = self._states.get(tenant_name)
        if state is None:
            return None
        state.refill(self._clock())
        return Usage(
            state.requests.level if state.requests is not None else None,
            state.tokens.level if state.tokens is not None else None,
            state.in_flight,
        )
