"""Per-tenant rate limits with a fake clock: exact waits, headers, settling, hot reload."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.gateway.auth import Tenant
from kvserve.gateway.keys import KeyLimits
from kvserve.gateway.ratelimit import (
    Admission,
    LimitExceeded,
    RateLimited,
    RateLimiter,
    RequestTooLarge,
    TooManySequences,
)
from kvserve.gateway.token_bucket import format_duration, retry_after_header


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tenant(
    name: str = "t",
    rpm: int | None = None,
    tpm: int | None = None,
    concurrent: int | None = None,
) -> Tenant:
    limits = KeyLimits(requests_per_minute=rpm, tokens_per_minute=tpm, max_concurrent=concurrent)
    return Tenant(name, "standard", limits, frozenset({"*"}))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def limiter(clock: FakeClock) -> RateLimiter:
    return RateLimiter(clock)


def rejected(limiter: RateLimiter, who: Tenant, tokens: int = 0, sequences: int = 1) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        limiter.admit(who, tokens, sequences)
    return info.value


# ------------------------------------------------------------------------ formatting


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-1, "0s"),
        (0.0004, "1ms"),
        (0.25, "250ms"),
        (0.9999, "1s"),
        (1, "1s"),
        (1.5, "1.5s"),
        (1.05, "1.05s"),
        (59.999, "59.999s"),
        (60, "1m0s"),
        (90.5, "1m30.5s"),
        (360, "6m0s"),
        (3723, "1h2m3s"),
        (3600, "1h0m0s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "1"), (0.01, "1"), (1.0, "1"), (1.0000000001, "1"), (1.2, "2")]
)
def test_retry_after_header(seconds: float, text: str) -> None:
    assert retry_after_header(seconds) == text


# -------------------------------------------------------------------------- requests


def test_unlimited_tenant_has_no_headers(limiter: RateLimiter) -> None:
    free = tenant()
    admissions = [limiter.admit(free, 10**9) for _ in range(1000)]
    assert all(a.headers == {} for a in admissions)
    assert all(a.finish(5) for a in admissions)


def test_requests_per_minute_exact_waits(limiter: RateLimiter, clock: FakeClock) -> None:
    who = tenant(rpm=60)  # refills 1 request per second
    first = limiter.admit(who, 0)
    assert first.headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
    }
    for _ in range(59):
        last = limiter.admit(who, 0)
    assert last.headers["x-ratelimit-remaining-requests"] == "0"
    assert last.headers["x-ratelimit-reset-requests"] == "1m0s"

    error = rejected(limiter, who)
    assert error.reason == "rate_limited_requests" and error.retry_after_seconds == 1.0
    assert error.headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "retry-after": "1",
    }
    assert "60 requests per minute" in error.message
    clock.advance(0.25)
    error = rejected(limiter, who)
    assert error.retry_after_seconds == pytest.approx(0.75)
    assert error.headers["retry-after"] == "1"
    assert error.headers["x-ratelimit-reset-requests"] == "59.75s"
    clock.advance(0.75)
    assert limiter.admit(who, 0).headers["x-ratelimit-remaining-requests"] == "0"


def test_slow_refill_retry_after_rounds_up(limiter: RateLimiter, clock: FakeClock) -> None:
    who = tenant(rpm=6)  # one request every 10 s
    for _ in range(6):
        limiter.admit(who, 0)
    assert rejected(limiter, who).headers["retry-after"] == "10"
    clock.advance(2.5)
    error = rejected(limiter, who)
    assert error.retry_after_seconds == pytest.approx(7.5) and error.headers["retry-after"] == "8"


# ---------------------------------------------------------------------------- tokens


def test_token_reservation_and_settle(limiter: RateLimiter, clock: FakeClock) -> None:
    who = tenant(tpm=600)  # refills 10 tokens per second
    big = limiter.admit(who, 500)
    assert big.headers == {
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "100",
        "x-ratelimit-reset-tokens": "50s",
    }
    error = rejected(limiter, who, 200)
    assert error.reason == "rate_limited_tokens"
    assert error.retry_after_seconds == pytest.approx(10.0) and error.headers["retry-after"] == "10"
    assert "reserves 200" in error.message

    assert big.finish(300)  # used 300 of the 500 reserved: 200 come back
    assert limiter.usage("t") is not None
    assert limiter.usage("t").tokens_available == pytest.approx(300)  # type: ignore[union-attr]
    small = limiter.admit(who, 200)
    assert small.headers["x-ratelimit-remaining-tokens"] == "100"

    small.finish(250)  # overran its reservation by 50: charged
    assert limiter.usage("t").tokens_available == pytest.approx(50)  # type: ignore[union-attr]


def test_an_overrun_is_debt_and_a_refund_never_overfills(
    limiter: RateLimiter, clock: FakeClock
) -> None:
    who = tenant(tpm=600)
    everything = limiter.admit(who, 600)
    everything.finish(1_000)  # 400 more than reserved: owed, not forgiven
    assert limiter.usage("t").tokens_available == -400  # type: ignore[union-attr]
    clock.advance(40)  # refill 10/s pays the debt back to 0
    with pytest.raises(RateLimited) as info:
        limiter.admit(who, 100)
    assert info.value.retry_after_seconds == pytest.approx(10)
    clock.advance(10)
    early = limiter.admit(who, 100)
    clock.advance(60)  # refilled to full while it ran
    early.finish(0)
    assert limiter.usage("t").tokens_available == 600  # type: ignore[union-attr]


def test_reservation_larger_than_the_limit_is_request_too_large(limiter: RateLimiter) -> None:
    who = tenant(rpm=60, tpm=600)
    with pytest.raises(RequestTooLarge) as info:
        limiter.admit(who, 601)
    error = info.value
    assert isinstance(error, LimitExceeded) and not isinstance(error, RateLimited)
    assert (error.requested, error.limit, error.reason) == (601, 600, "rate_limited_tokens")
    assert "retry-after" not in error.headers
    assert error.headers["x-ratelimit-remaining-requests"] == "60"  # nothing taken
    assert "601" in error.message and "600" in error.message
    limiter.admit(who, 600)  # exactly the limit fits


def test_negative_numbers_are_programming_errors(limiter: RateLimiter) -> None:
    with pytest.raises(ValueError, match="estimated_tokens"):
        limiter.admit(tenant(), -1)
    with pytest.raises(ValueError, match="actual_tokens"):
        limiter.admit(tenant(), 1).finish(-1)


# ----------------------------------------------------------------------- concurrency


def test_concurrency_slots_and_idempotent_finish(limiter: RateLimiter) -> None:
    who = tenant(concurrent=2)
    a, b = limiter.admit(who, 0), limiter.admit(who, 0)
    error = rejected(limiter, who)
    assert error.reason == "concurrency" and error.retry_after_seconds == 1.0
    assert error.headers == {"retry-after": "1"}
    assert a.finish(0) and not a.finish(0) and not a.finish(0)
    assert limiter.usage("t").in_flight == 1  # type: ignore[union-attr]
    c = limiter.admit(who, 0)
    rejected(limiter, who)
    b.finish(0)
    c.finish(0)
    assert limiter.usage("t").in_flight == 0  # type: ignore[union-attr]


def test_each_sequence_of_a_request_holds_a_concurrency_slot(limiter: RateLimiter) -> None:
    """A request for n answers (or a batch of prompts) runs that many engine requests: it
    holds as many slots, waits while they are not free, and is refused outright (no
    retry-after) when it needs more than the limit."""
    who = tenant(concurrent=4)
    three = limiter.admit(who, 0, sequences=3)
    assert rejected(limiter, who, 0, sequences=2).reason == "concurrency"
    one = limiter.admit(who, 0)
    assert limiter.usage("t").in_flight == 4  # type: ignore[union-attr]
    three.finish(0)
    assert limiter.usage("t").in_flight == 1  # type: ignore[union-attr]
    with pytest.raises(TooManySequences, match="5 sequences") as never:
        limiter.admit(who, 0, sequences=5)
    assert "retry-after" not in never.value.headers
    one.finish(0)
    assert limiter.usage("t").in_flight == 0  # type: ignore[union-attr]


def test_rejection_consumes_nothing(limiter: RateLimiter) -> None:
    who = tenant(rpm=60, tpm=600, concurrent=5)
    limiter.admit(who, 550)
    before = limiter.usage("t")
    for tokens in (100, 51):
        rejected(limiter, who, tokens)
    assert limiter.usage("t") == before
    limiter.admit(who, 50)


def test_longest_wait_names_the_reason(limiter: RateLimiter, clock: FakeClock) -> None:
    who = tenant(rpm=1, tpm=600, concurrent=1)
    held = limiter.admit(who, 600)
    error = rejected(limiter, who, 300)  # requests: 60 s, tokens: 30 s, concurrency: 1 s
    assert error.reason == "rate_limited_requests" and error.retry_after_seconds == 60
    assert error.headers["retry-after"] == "60"
    clock.advance(50)  # requests: 10 s, tokens: 30 - 50 < 0 → fits
    error = rejected(limiter, who, 600)  # tokens: 10 s (500 there), requests 10 s, conc 1 s
    assert error.headers["retry-after"] == "10"
    held.finish(600)
    clock.advance(10)
    limiter.admit(who, 600)


def test_tenants_are_independent(limiter: RateLimiter) -> None:
    a, b = tenant("a", rpm=1), tenant("b", rpm=1)
    limiter.admit(a, 0)
    rejected(limiter, a)
    limiter.admit(b, 0)


# ------------------------------------------------------------------------ hot reload


def test_new_limits_keep_usage(limiter: RateLimiter) -> None:
    old = tenant(rpm=600, tpm=1000)
    for _ in range(100):
        limiter.admit(old, 5)
    limiter.update([tenant(rpm=300, tpm=2000)])
    usage = limiter.usage("t")
    assert usage is not None
    assert usage.requests_available == pytest.approx(200)
    assert usage.tokens_available == pytest.approx(1500)


def test_limits_change_when_a_reloaded_tenant_is_admitted(limiter: RateLimiter) -> None:
    limiter.admit(tenant(rpm=10), 0)
    admission = limiter.admit(tenant(rpm=2), 0)  # the reloaded Tenant carries new limits
    assert admission.headers["x-ratelimit-limit-requests"] == "2"
    assert admission.headers["x-ratelimit-remaining-requests"] == "0"
    rejected(limiter, tenant(rpm=2))


def test_removing_and_adding_limits(limiter: RateLimiter, clock: FakeClock) -> None:
    held = limiter.admit(tenant(tpm=100, concurrent=1), 100)
    unlimited = limiter.admit(tenant(), 10**6)  # limits removed: nothing to enforce
    assert unlimited.headers == {}
    held.finish(0)  # settles against the bucket it reserved from: harmless
    fresh = limiter.admit(tenant(rpm=5), 0)  # a newly added limit starts full
    assert fresh.headers["x-ratelimit-remaining-requests"] == "4"


def test_lower_concurrency_waits_for_in_flight_to_drain(limiter: RateLimiter) -> None:
    held = [limiter.admit(tenant(concurrent=3), 0) for _ in range(3)]
    limiter.update([tenant(concurrent=1)])
    rejected(limiter, tenant(concurrent=1))
    held[0].finish(0)
    held[1].finish(0)
    rejected(limiter, tenant(concurrent=1))
    held[2].finish(0)
    limiter.admit(tenant(concurrent=1), 0)


def test_removed_tenants_are_forgotten_once_idle(limiter: RateLimiter) -> None:
    gone = limiter.admit(tenant("gone", concurrent=1), 0)
    limiter.admit(tenant("stays", rpm=5), 0).finish(0)
    limiter.update([tenant("stays", rpm=5)])
    assert limiter.usage("gone") is not None  # still has a request in flight
    gone.finish(0)
    limiter.update([tenant("stays", rpm=5)])
    assert limiter.usage("gone") is None
    assert limiter.usage("stays").requests_available == pytest.approx(4)  # type: ignore[union-attr]


# ---------------------------------------------------------------------- properties

NAMES = ("a", "b")
limit = st.one_of(st.none(), st.integers(1, 100))


class LimiterMachine(RuleBasedStateMachine):
    """Any sequence of admit / finish / clock advance / reload keeps the invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.limiter = RateLimiter(self.clock)
        self.tenants = {name: tenant(name, 10, 100, 3) for name in NAMES}
        self.open: list[tuple[str, Admission, int]] = []  # (tenant, admission, epoch)
        # Bumped when a tenant's token limit is removed: an admission from before then
        # settles against a bucket that is no longer the tenant's (and is not checked).
        self.epoch = dict.fromkeys(NAMES, 0)
        # Tokens finished requests used beyond their reservations: the most that is owed.
        self.overrun = dict.fromkeys(NAMES, 0)

    @rule(name=st.sampled_from(NAMES), tokens=st.integers(0, 60))
    def admit(self, name: str, tokens: int) -> None:
        who = self.tenants[name]
        limits = who.limits
        self.limiter.update(self.tenants.values())  # apply limits before looking
        before = self.limiter.usage(name)
        fits = {  # room with a margin either way; None: too close to call
            "requests": _room(before.requests_available if before else None, 1),
            "tokens": _room(before.tokens_available if before else None, tokens),
            "concurrency": before is None
            or limits.max_concurrent is None
            or before.in_flight < limits.max_concurrent,
        }
        try:
            admission = self.limiter.admit(who, tokens)
        except RequestTooLarge:
            assert limits.tokens_per_minute is not None and tokens > limits.tokens_per_minute
            if before is not None:
                assert self.limiter.usage(name) == before
            return
        except RateLimited as error:
            assert False in fits.values()
            dimension = {
                "rate_limited_requests": "requests",
                "rate_limited_tokens": "tokens",
                "concurrency": "concurrency",
            }[error.reason]
            assert fits[dimension] is not True
            assert error.retry_after_seconds > 0 and int(error.headers["retry-after"]) >= 1
            assert self.limiter.usage(name) == before  # a rejection consumes nothing
            return
        assert all(fits.values()) or None in fits.values()
        usage = self.limiter.usage(name)
        assert usage is not None
        if limits.max_concurrent is not None:
            assert usage.in_flight <= limits.max_concurrent
        self.open.append((name, admission, self.epoch[name]))

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        name, admission, epoch = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        actual = data.draw(st.integers(0, 2 * admission.reserved_tokens + 5))  # under or over
        before = self.limiter.usage(name)
        assert admission.finish(actual)
        assert not admission.finish(actual)
        after = self.limiter.usage(name)
        assert before is not None and after is not None
        assert after.in_flight == before.in_flight - 1
        capacity = self.tenants[name].limits.tokens_per_minute
        if (
            capacity is not None
            and before.tokens_available is not None
            and after.tokens_available is not None
            and admission.reserved_tokens > 0
            and epoch == self.epoch[name]
        ):
            expected = before.tokens_available + admission.reserved_tokens - actual
            assert after.tokens_available == pytest.approx(min(capacity, expected))
        self.overrun[name] += max(0, actual - admission.reserved_tokens)

    @rule(seconds=st.floats(0, 20, allow_nan=False))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(name=st.sampled_from(NAMES), rpm=limit, tpm=limit, concurrent=limit)
    def reload(self, name: str, rpm: int | None, tpm: int | None, concurrent: int | None) -> None:
        self.tenants[name] = tenant(name, rpm, tpm, concurrent)
        if tpm is None:
            self.epoch[name] += 1
        self.limiter.update(self.tenants.values())

    @invariant()
    def within_bounds(self) -> None:
        for name in NAMES:
            usage = self.limiter.usage(name)
            if usage is None:
                continue
            assert usage.in_flight == sum(1 for n, _, _ in self.open if n == name)
            limits = self.tenants[name].limits
            for level, capacity, debt in (
                (usage.requests_available, limits.requests_per_minute, 0),
                (usage.tokens_available, limits.tokens_per_minute, self.overrun[name]),
            ):
                if level is not None and capacity is not None:
                    # Overruns are owed (debt), never more than they added up to.
                    assert -debt - 1e-6 <= level <= capacity


def _room(level: float | None, amount: int) -> bool | None:
    if level is None:
        return True
    if level >= amount + 1e-6:
        return True
    if level < amount - 1e-6:
        return False
    return None


LimiterMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_limiter_invariants = LimiterMachine.TestCase
