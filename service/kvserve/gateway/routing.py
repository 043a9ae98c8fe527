"""Routing: which replica serves a request.

Three policies share one interface, ``route(key, replicas, exclude) → RouteDecision | None``:

- ``prefix`` (default, :class:`ConsistentHashRouter`): a consistent-hash ring over the
  replicas, keyed by :func:`prefix_key`. Requests that start with the same text land on
  the same replica, whose prefix cache already holds the KV blocks for that text, so
  their prefill is mostly skipped. Plain consistent hashing lets one hot prefix overload
  its replica, so the ring uses *bounded loads* (Mirrokni, Thorup, Zadimoghaddam,
  "Consistent Hashing with Bounded Loads", 2018): a replica takes a request only while
  its load stays within ``ceil(load_factor × (total_load + 1) / n)``; otherwise the
  request walks clockwise to the next replica under the bound. A hot prefix thus spills
  onto a few neighbours (which then cache it too) and comes home when load drops.
- ``least_load`` (:class:`LeastLoadRouter`): fewest in-flight + waiting requests; best
  balance, no cache affinity.
- ``round_robin`` (:class:`RoundRobinRouter`): a baseline for comparison.

A request for a LoRA adapter goes through ``gateway.adapters.route_adapter`` around the
policy: the replicas that serve the adapter first, while under the same load bound
(:func:`load_bound`); else the least loaded replica with LoRA on, which the caller asks
to load the adapter first.

Routers only choose; they never count. The load they read is a snapshot
(:class:`ReplicaLoad`) built by the caller from the gateway's own in-flight counts
(exact, see ``slots.ReplicaSlots``) and each replica's last ``GetLoad``.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

RoutingPolicy = Literal["prefix", "least_load", "round_robin"]
ROUTING_POLICIES: tuple[RoutingPolicy, ...] = ("prefix", "least_load", "round_robin")

DEFAULT_PREFIX_CHARS = 512
DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_VIRTUAL_NODES = 100
MAX_RINGS = 64  # rings a ConsistentHashRouter keeps (one per replica set it was asked about)


def _content_text(content: Any) -> str:
    """The text of a message's ``content``: a string, or the text parts of a part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                pieces.append(text if isinstance(text, str) else f"<{part.get('type', '?')}>")
            else:
                pieces.append(str(part))
        return "".join(pieces)
    return str(content)


def _prompt_text(prompt: Any) -> str:
    """A completions ``prompt`` as text: a string, token ids, or the first of a batch."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            # Token ids: same ids → same text, which is all a hash key needs.
            return " ".join(str(token) for token in prompt)
        # A batch (list of strings or of token-id lists): route by its first prompt.
        return _prompt_text(first)
    return ""


def prefix_key(body: Mapping[str, Any], prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str:
    """The text that identifies a request's shareable prefix, for prefix-affinity routing.

    An engine's prefix cache is keyed on the *leading* KV blocks of the prompt: two
    requests share cached blocks only up to where their token sequences first differ.
    So the key is the leading text only: for chat, the messages up to and including the
    first user message (the system prompt(s) + first user message, with role markers);
    for completions, the prompt (token ids rendered as text). That text is cut to
    ``prefix_chars`` so a long unique tail (the part that is never shared) cannot send
    otherwise-identical prefixes to different replicas. A ``cache_salt`` and a
    ``lora_adapter`` in the body are part of the key: the engine shares blocks across
    neither salts nor adapters.
    """
    if prefix_chars <= 0:
        raise ValueError(f"prefix_chars must be positive, got {prefix_chars}")
    salt = body.get("cache_salt")
    head = f"<|salt|>{salt}\n" if isinstance(salt, str) and salt else ""
    adapter = body.get("lora_adapter")
    if isinstance(adapter, str) and adapter:
        head += f"<|lora|>{adapter}\n"
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            role = str(message.get("role", ""))
            parts.append(f"<|{role}|>{_content_text(message.get('content'))}\n")
            if role == "user":
                break
        text = "".join(parts)
    else:
        text = _prompt_text(body.get("prompt"))
    return head + text[:prefix_chars]  # the salt and adapter whole: never cut into


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as a router sees it at decision time.

    ``in_flight`` is the gateway's own count of requests it has sent there and not yet
    finished (exact and current); ``waiting``/``running`` come from the replica's last
    ``GetLoad`` (stale by up to one poll, and they include traffic from other gateways),
    as do ``adapters`` (the LoRA adapters it serves, plus any this gateway is loading
    there) and ``lora_slots`` (0: LoRA off).
    """

    address: str
    in_flight: int
    waiting: int
    running: int
    capacity: int
    healthy: bool = True
    draining: bool = False
    adapters: frozenset[str] = frozenset()
    lora_slots: int = 0

    @property
    def routable(self) -> bool:
        """Up and accepting new work (it may still be full)."""
        return self.healthy and not self.draining

    @property
    def full(self) -> bool:
        """No free slot: the gateway already has ``capacity`` requests in flight there."""
        return self.in_flight >= self.capacity


@dataclass(frozen=True)
class RouteDecision:
    """Where to send a request; ``overridden`` when that is not the prefix's home replica
    (or, for an adapter, not a replica that serves it); ``load_adapter``: the adapter the
    caller must have the replica load before sending the request there."""

    address: str
    overridden: bool = False
    load_adapter: str | None = None


class Router(Protocol):
    """Chooses a replica; ``None`` when no replica is routable, unexcluded and not full."""

    def route(
        self, key: str, replicas: Sequence[ReplicaLoad], exclude: Collection[str] = ()
    ) -> RouteDecision | None: ...


def eligible(replica: ReplicaLoad, exclude: Collection[str]) -> bool:
    """Whether a router may pick ``replica`` now: routable, not full, not excluded."""
    return replica.routable and not replica.full and replica.address not in exclude


def load_bound(replicas: Sequence[ReplicaLoad], load_factor: float) -> int:
    """The bounded-loads rule: the most in-flight requests a replica may have after taking
    one more, ``ceil(load_factor × (total + 1) / n)`` over the routable replicas."""
    routable = [replica for replica in replicas if replica.routable]
    if not routable:
        return 0
    total = sum(replica.in_flight for replica in routable)
    return math.ceil(load_factor * (total + 1) / len(routable))


def _hash64(text: str) -> int:
    """A stable 64-bit hash (Python's ``hash`` is salted per process, so replicas of the
    gateway would disagree and every restart would reshuffle the ring)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


class _Ring:
    """The hash ring: ``virtual_nodes`` points per address, sorted by position."""

    def __init__(self, addresses: frozenset[str], virtual_nodes: int) -> None:
        points = sorted(
            (_hash64(f"{address}#{index}"), address)
            for address in addresses
            for index in range(virtual_nodes)
        )
        self.addresses = addresses
        self._positions = [position for position, _ in points]
        self._owners = [owner for _, owner in points]

    def walk(self, key: str) -> Iterator[str]:
        """Distinct addresses clockwise from the key's position (its first choice first)."""
        if not self._owners:
            return
        start = bisect.bisect_right(self._positions, _hash64(key))
        seen: set[str] = set()
        count = len(self._owners)
        for step in range(count):
            owner = self._owners[(start + step) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.addresses):
                    return


class ConsistentHashRouter:
    """Policy ``prefix``: consistent hashing with bounded loads (see the module docstring).

    The ring holds every replica the caller passes; unroutable (unhealthy or draining)
    ones are skipped on the walk, which is exactly what removing them would do, so a
    replica that flaps does not rebuild the ring. The key's *home* is the first routable
    replica clockwise; ``overridden`` says the request went elsewhere because the home was
    over the load bound, full, or excluded (a retry), which is the affinity the policy
    gave up. Load is the gateway's own in-flight count (exact, unlike ``GetLoad``).
    """

    def __init__(
        self,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
    ) -> None:
        if not load_factor >= 1.0:
            # Below 1 the bound can be under the mean load: no replica would qualify.
            raise ValueError(f"load_factor must be ≥ 1, got {load_factor}")
        if virtual_nodes <= 0:
            raise ValueError(f"virtual_nodes must be positive, got {virtual_nodes}")
        self.load_factor = load_factor
        self.virtual_nodes = virtual_nodes
        # A few rings, by address set: adapter requests route over the subsets that serve
        # their adapter, and alternating with the whole set must not rebuild a ring each time.
        self._rings: dict[frozenset[str], _Ring] = {}

    def _ring_for(self, addresses: frozenset[str]) -> _Ring:
        ring = self._rings.get(addresses)
        if ring is None:
            if len(self._rings) >= MAX_RINGS:
                del self._rings[next(iter(self._rings))]  # the oldest built
            ring = self._rings[addresses] = _Ring(addresses, self.virtual_nodes)
        return ring

    def bound(self, replicas: Sequence[ReplicaLoad]) -> int:
        """The most in-flight requests a replica may have after taking one more."""
        return load_bound(replicas, self.load_factor)

    def home(self, key: str, replicas: Sequence[ReplicaLoad]) -> str | None:
        """The key's first routable replica clockwise, ignoring load and exclusion."""
        by_address = {replica.address: replica for replica in replicas}
        for address in self._ring_for(frozenset(by_address)).walk(key):
            if by_address[address].routable:
                return address
        return None

    def route(
        self, key: str, replicas: Sequence[ReplicaLoad], exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        by_address = {replica.address: replica for replica in replicas}
        bound = self.bound(list(by_address.values()))
        home: str | None = None
        fallback: str | None = None
        for address in self._ring_for(frozenset(by_address)).walk(key):
            replica = by_address[address]
            if not replica.routable:
                continue
            if home is None:
                home = address
            if not eligible(replica, exclude):
                continue
            if replica.in_flight + 1 <= bound:
                return RouteDecision(address, overridden=address != home)
            if fallback is None:
                fallback = address
        # Every replica with a free slot is over the bound (possible only when the
        # under-loaded ones are excluded): capacity is the hard limit, the bound is not,
        # so serve from the first free replica clockwise rather than refuse.
        if fallback is None:
            return None
        return RouteDecision(fallback, overridden=fallback != home)


def _next_after(candidates: list[str], last: str | None) -> str:
    """The first of the sorted ``candidates`` after ``last``, wrapping around."""
    if last is not None:
        index = bisect.bisect_right(candidates, last)
        if index < len(candidates):
            return candidates[index]
    return candidates[0]


class _Turns:
    """Whose turn it is, per pool of replicas (a model's; an adapter's holders): one
    router serves every model, and a single memory made interleaved models' requests
    reset each other's rotation to the first address."""

    MAX_POOLS = 1024  # pools change with discovery; the least recently used are dropped

    def __init__(self) -> None:
        self._last: OrderedDict[frozenset[str], str] = OrderedDict()

    def next(self, replicas: Sequence[ReplicaLoad], candidates: list[str]) -> str:
        """The first of the sorted ``candidates`` after this pool's last choice."""
        pool = frozenset(replica.address for replica in replicas)
        choice = self._last[pool] = _next_after(candidates, self._last.get(pool))
        self._last.move_to_end(pool)
        if len(self._last) > self.MAX_POOLS:
            self._last.popitem(last=False)
        return choice


class LeastLoadRouter:
    """Policy ``least_load``: fewest in-flight + waiting requests.

    ``in_flight`` is this gateway's exact share and ``waiting`` the replica's own queue
    (traffic from anywhere). Ties rotate in address order, so equal replicas take turns
    instead of the first one absorbing every burst between load updates.
    """

    def __init__(self) -> None:
        self._turns = _Turns()

    def route(
        self, key: str, replicas: Sequence[ReplicaLoad], exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        candidates = [replica for replica in replicas if eligible(replica, exclude)]
        if not candidates:
            return None
        least = min(replica.in_flight + replica.waiting for replica in candidates)
        tied = sorted(
            replica.address
            for replica in candidates
            if replica.in_flight + replica.waiting == least
        )
        return RouteDecision(self._turns.next(replicas, tied))


class RoundRobinRouter:
    """Policy ``round_robin``: each eligible replica in address order, in turn.

    It remembers the last address rather than an index, so replicas joining or leaving
    do not make it skip or repeat the others.
    """

    def __init__(self) -> None:
        self._turns = _Turns()

    def route(
        self, key: str, replicas: Sequence[ReplicaLoad], exclude: Collection[str] = ()
    ) -> RouteDecision | None:
        candidates = sorted({r.address for r in replicas if eligible(r, exclude)})
        if not candidates:
            return None
        return RouteDecision(self._turns.next(replicas, candidates))


def make_router(policy: RoutingPolicy, load_factor: float = DEFAULT_LOAD_FACTOR) -> Router:
    """The router for a configured policy (``load_factor`` applies to ``prefix`` only)."""
    if policy == "prefix":
        return ConsistentHashRouter(load_factor=load_factor)
    if policy == "least_load":
        return LeastLoadRouter()
    if policy == "round_robin":
        return RoundRobinRouter()
    raise ValueError(f"unknown routing policy {policy!r}; allowed: {', '.join(ROUTING_POLICIES)}")
