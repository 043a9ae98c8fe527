"""Routing policies: prefix affinity with bounded loads, least load, round robin."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.gateway.routing import (
    ConsistentHashRouter,
    LeastLoadRouter,
    ReplicaLoad,
    RoundRobinRouter,
    RouteDecision,
    make_router,
    prefix_key,
)


def fleet(*addresses: str, capacity: int = 1000) -> list[ReplicaLoad]:
    return [ReplicaLoad(a, in_flight=0, waiting=0, running=0, capacity=capacity) for a in addresses]


def with_load(replicas: list[ReplicaLoad], loads: dict[str, int]) -> list[ReplicaLoad]:
    """The replicas with the given in-flight counts by address."""
    return [replace(r, in_flight=loads.get(r.address, r.in_flight)) for r in replicas]


def assignments(
    router: ConsistentHashRouter, replicas: list[ReplicaLoad], keys: list[str]
) -> dict[str, str]:
    result: dict[str, str] = {}
    for key in keys:
        decision = router.route(key, replicas)
        assert decision is not None
        result[key] = decision.address
    return result


KEYS = [f"<|system|>You are assistant number {i}.\n<|user|>hello {i * 7919}\n" for i in range(4000)]


# --- prefix_key --------------------------------------------------------------------------


def test_prefix_key_chat_is_system_prompts_and_first_user_message() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Salut"},
            {"role": "user", "content": "More"},
        ]
    }
    assert prefix_key(body) == "<|system|>Be brief.\n<|system|>Answer in French.\n<|user|>Hi\n"
    # Later turns don't change the key: the shared prefix is the conversation's start.
    shorter = {"messages": body["messages"][:3]}
    assert prefix_key(shorter) == prefix_key(body)


def test_prefix_key_chat_roles_matter_and_parts_are_text() -> None:
    as_user = {"messages": [{"role": "user", "content": "Be brief."}]}
    as_system = {"messages": [{"role": "system", "content": "Be brief."}]}
    assert prefix_key(as_user) != prefix_key(as_system)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Be brief."}]}]}
    assert prefix_key(parts) == prefix_key(as_user)


def test_prefix_key_completions_text_token_ids_and_batches() -> None:
    assert prefix_key({"prompt": "Once upon a time"}) == "Once upon a time"
    assert prefix_key({"prompt": ["Once upon a time"]}) == "Once upon a time"
    assert prefix_key({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prefix_key({"prompt": [[1, 2, 3]]}) == "1 2 3"
    assert prefix_key({"prompt": [1, 2, 3]}) != prefix_key({"prompt": [1, 23]})
    assert prefix_key({}) == ""


def test_prefix_key_truncates_so_unique_tails_do_not_matter() -> None:
    system = "S" * 600
    a = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "a"}]}
    b = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "b"}]}
    assert len(prefix_key(a)) == 512
    assert prefix_key(a) == prefix_key(b)
    assert prefix_key(a, prefix_chars=1000) != prefix_key(b, prefix_chars=1000)
    assert prefix_key({"prompt": "x" * 100}, prefix_chars=10) == "x" * 10


def test_prefix_key_includes_cache_salt() -> None:
    body = {"prompt": "same"}
    assert prefix_key({**body, "cache_salt": "t1"}) != prefix_key({**body, "cache_salt": "t2"})


def test_prefix_chars_counts_the_prompt_not_the_salt() -> None:
    """A tenant's salt (73 characters from the gateway) once ate into prefix_chars: with
    64, no prompt character was hashed and every request of a tenant had one home."""
    salt = "h" * 64
    a, b = {"prompt": "alpha", "cache_salt": salt}, {"prompt": "bravo", "cache_salt": salt}
    assert prefix_key(a, prefix_chars=64) != prefix_key(b, prefix_chars=64)
    assert prefix_key(a, prefix_chars=3).endswith("alp")


# --- consistent hashing -------------------------------------------------------------------


def test_same_key_same_replica_and_a_new_router_agrees() -> None:
    replicas = fleet("10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051")
    first = assignments(ConsistentHashRouter(), replicas, KEYS[:200])
    again = assignments(ConsistentHashRouter(), list(reversed(replicas)), KEYS[:200])
    assert first == again  # stable hash: independent of process, order and history


def test_keys_spread_roughly_evenly() -> None:
    replicas = fleet("a:1", "b:1", "c:1")
    counts = Counter(assignments(ConsistentHashRouter(), replicas, KEYS).values())
    assert set(counts) == {"a:1", "b:1", "c:1"}
    for count in counts.values():
        assert 0.22 < count / len(KEYS) < 0.45, counts


def test_adding_a_replica_moves_only_its_share_of_keys() -> None:
    five = fleet(*(f"r{i}:1" for i in range(5)))
    six = fleet(*(f"r{i}:1" for i in range(6)))
    router = ConsistentHashRouter()
    before = assignments(router, five, KEYS)
    after = assignments(router, six, KEYS)
    moved = [key for key in KEYS if before[key] != after[key]]
    assert all(after[key] == "r5:1" for key in moved)  # keys only move to the newcomer
    assert 0.08 < len(moved) / len(KEYS) < 0.26  # ~1/6


def test_removing_a_replica_moves_only_its_keys() -> None:
    five = fleet(*(f"r{i}:1" for i in range(5)))
    router = ConsistentHashRouter()
    before = assignments(router, five, KEYS)
    after = assignments(router, five[:-1], KEYS)
    moved = [key for key in KEYS if before[key] != after[key]]
    assert all(before[key] == "r4:1" for key in moved)
    assert 0.1 < len(moved) / len(KEYS) < 0.3  # ~1/5
    # An unhealthy or draining replica is skipped exactly as if it were removed.
    for down in (replace(five[-1], healthy=False), replace(five[-1], draining=True)):
        assert assignments(router, [*five[:-1], down], KEYS) == after
        assert all(router.home(key, [*five[:-1], down]) == after[key] for key in KEYS[:300])


def test_bounded_load_spills_a_hot_key_and_brings_it_back() -> None:
    router = ConsistentHashRouter(load_factor=1.25)
    replicas = fleet("a:1", "b:1", "c:1")
    key = KEYS[0]
    home = router.route(key, replicas)
    assert home is not None and not home.overridden
    # bound = ceil(1.25 × (total + 1) / 3); with the home at 2 and the others idle the
    # bound is ceil(1.25 × 3 / 3) = 2, and 2 + 1 > 2: the key spills.
    hot = [replace(r, in_flight=2) if r.address == home.address else r for r in replicas]
    spilled = router.route(key, hot)
    assert spilled is not None
    assert spilled.address != home.address and spilled.overridden
    # Load evens out (home 3, others 2 → bound ceil(1.25 × 8 / 3) = 4, and 3 + 1 ≤ 4):
    # the key goes home again.
    busy = [replace(r, in_flight=3 if r.address == home.address else 2) for r in replicas]
    back = router.route(key, busy)
    assert back == home
    # Load dropped entirely: home again, not overridden.
    assert router.route(key, replicas) == home


def test_hot_key_never_pushes_any_replica_past_the_bound() -> None:
    router = ConsistentHashRouter(load_factor=1.25)
    replicas = fleet("a:1", "b:1", "c:1", "d:1")
    loads = dict.fromkeys(["a:1", "b:1", "c:1", "d:1"], 0)
    overridden = 0
    for _ in range(200):
        current = [replace(r, in_flight=loads[r.address]) for r in replicas]
        bound = math.ceil(1.25 * (sum(loads.values()) + 1) / 4)
        decision = router.route(KEYS[7], current)
        assert decision is not None
        loads[decision.address] += 1
        assert loads[decision.address] <= bound
        overridden += decision.overridden
    # One hot key ends up spread over the whole fleet, most of it as overrides.
    assert all(load > 0 for load in loads.values()) and overridden > 100


def test_exclusion_is_an_override_and_unroutable_or_full_replicas_are_never_chosen() -> None:
    router = ConsistentHashRouter()
    replicas = fleet("a:1", "b:1", "c:1", capacity=2)
    for key in KEYS[:100]:
        home = router.route(key, replicas)
        assert home is not None
        retried = router.route(key, replicas, exclude={home.address})
        assert retried is not None and retried.address != home.address and retried.overridden
    bad = [
        replace(replicas[0], healthy=False),
        replace(replicas[1], draining=True),
        replace(replicas[2], in_flight=2),
    ]
    for key in KEYS[:50]:
        assert router.route(key, bad) is None
    only_c = [bad[0], bad[1], replicas[2]]
    for key in KEYS[:50]:
        decision = router.route(key, only_c)
        # c is the only routable replica, so it is every key's home: not an override.
        assert decision is not None and decision.address == "c:1" and not decision.overridden
    assert router.route(KEYS[0], only_c, exclude={"c:1"}) is None
    assert router.route(KEYS[0], []) is None


def test_free_replica_over_the_bound_still_serves_when_the_rest_are_excluded() -> None:
    # b is far over the bound but has free capacity; a (idle) is excluded: b serves
    # (capacity is the hard limit, the load bound only a preference).
    replicas = with_load(fleet("a:1", "b:1", capacity=100), {"b:1": 50})
    decision = ConsistentHashRouter().route(KEYS[0], replicas, exclude={"a:1"})
    assert decision is not None and decision.address == "b:1"


@settings(max_examples=60, deadline=None)
@given(
    loads=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    down=st.sets(st.integers(0, 5)),
    key=st.text(max_size=20),
)
def test_prefix_choice_is_eligible_and_within_bound_when_possible(
    loads: list[int], down: set[int], key: str
) -> None:
    replicas = [
        ReplicaLoad(f"r{i}:1", load, waiting=0, running=0, capacity=10, healthy=i not in down)
        for i, load in enumerate(loads)
    ]
    router = ConsistentHashRouter(load_factor=1.25)
    decision = router.route(key, replicas)
    eligible = [r for r in replicas if r.healthy and r.in_flight < r.capacity]
    if not eligible:
        assert decision is None
        return
    assert decision is not None
    chosen = next(r for r in replicas if r.address == decision.address)
    assert chosen in eligible
    bound = router.bound(replicas)
    if any(r.in_flight + 1 <= bound for r in eligible):
        assert chosen.in_flight + 1 <= bound
    assert decision.overridden == (decision.address != router.home(key, replicas))


def test_load_factor_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="load_factor"):
        ConsistentHashRouter(load_factor=0.9)


# --- least load, round robin, factory -------------------------------------------------------


def test_least_load_picks_the_minimum_of_in_flight_plus_waiting() -> None:
    replicas = [
        ReplicaLoad("a:1", in_flight=1, waiting=5, running=4, capacity=8),
        ReplicaLoad("b:1", in_flight=3, waiting=0, running=3, capacity=8),
        ReplicaLoad("c:1", in_flight=2, waiting=3, running=1, capacity=8),
    ]
    router = LeastLoadRouter()
    assert router.route("k", replicas) == RouteDecision("b:1")
    assert router.route("k", replicas, exclude={"b:1"}) == RouteDecision("c:1")
    full_b = [replicas[0], replace(replicas[1], in_flight=8), replicas[2]]
    assert router.route("k", full_b) == RouteDecision("c:1")


def test_least_load_rotates_among_ties() -> None:
    router = LeastLoadRouter()
    replicas = [*fleet("a:1", "b:1", "c:1"), *with_load(fleet("d:1"), {"d:1": 1})]
    picks = [router.route("k", replicas) for _ in range(6)]
    assert [p.address for p in picks if p] == ["a:1", "b:1", "c:1", "a:1", "b:1", "c:1"]


def test_round_robin_cycles_and_skips_ineligible() -> None:
    router = RoundRobinRouter()
    replicas = fleet("c:1", "a:1", "b:1", capacity=1)
    picks = [router.route("k", replicas) for _ in range(6)]
    assert [p.address for p in picks if p] == ["a:1", "b:1", "c:1", "a:1", "b:1", "c:1"]
    replicas[0] = replace(replicas[0], healthy=False)  # c down
    picks = [router.route("k", replicas) for _ in range(3)]
    assert [p.address for p in picks if p] == ["a:1", "b:1", "a:1"]
    full = [replace(r, in_flight=1) for r in replicas]
    assert router.route("k", full) is None


@pytest.mark.parametrize("router", [RoundRobinRouter(), LeastLoadRouter()])
def test_each_models_replicas_take_turns_when_models_interleave(
    router: RoundRobinRouter | LeastLoadRouter,
) -> None:
    """One router serves every model: model B's choice once reset model A's turn, so
    interleaved A, B requests all went to each model's first replica."""
    model_a, model_b = fleet("a:1", "a:2"), fleet("b:1", "b:2")
    picks: list[str] = []
    for _ in range(4):
        for replicas in (model_a, model_b):
            decision = router.route("k", replicas)
            assert decision is not None
            picks.append(decision.address)
    assert picks == ["a:1", "b:1", "a:2", "b:2"] * 2


def test_make_router_builds_each_policy() -> None:
    router = make_router("prefix", load_factor=2.0)
    assert isinstance(router, ConsistentHashRouter) and router.load_factor == 2.0
    assert isinstance(make_router("least_load"), LeastLoadRouter)
    assert isinstance(make_router("round_robin"), RoundRobinRouter)
    with pytest.raises(ValueError, match="allowed"):
        make_router("random")  # type: ignore[arg-type]
