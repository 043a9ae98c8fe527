"""The replicas behind each model: their clients, health and load, and what routers see.

Health is active and passive: a poller calls every replica's ``GetLoad`` each
``load_poll_seconds`` (a success marks it healthy again), and a request that fails to
reach it marks it unhealthy at once. A poll that fails marks it unhealthy too, at once if
the replica could not be reached, but only at the second in a row if it merely did not
answer within the poll's timeout (``SLOW_POLLS_UNHEALTHY``): a busy replica, or a busy
gateway, answers late now and then, and when every replica of a model was slow in the
same round the model turned all its traffic away with 503s while each replica was
serving. A second failed poll in a row also fails the requests open on the replica that
have had no output yet, as the replica's failure, so that they are retried on another
healthy replica (if the model has one) instead of waiting for a replica that may never
answer.

A *draining* replica gets no new requests while its in-flight ones finish. It drains
for either of two reasons, which routing, ``/ready`` and the metrics do not tell apart:
it left discovery (``removed``: its channel closes once its requests have finished, see
``reap``), or its own ``GetLoad`` says it is draining (``kvserve serve`` after SIGTERM:
it refuses new requests but answers polls while its streams finish; it stays a member,
and takes requests again if a later poll, say after a restart at the same address,
reports it admitting). A model removed from discovery (its Service deleted) is no longer
served: its replicas drain the same way, and requests held for its first replica stop
waiting.

The same poll reports the LoRA adapters each replica serves (``GetLoadResponse``'s
``lora_adapters`` and ``max_loras``); the gateway adds an adapter it has just loaded
there at once, without waiting for the next poll (``kvserve.gateway.adapters``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvserve.gateway.routing import ReplicaLoad
from kvserve.gateway.slots import ReplicaSlots
from kvserve.gateway.upstream import ReplicaClient

log = logging.getLogger("kvserve.gateway")


# Failed load polls in a row after which a replica's requests without output yet are
# retried elsewhere (Fleet._give_up_unanswered).
UNANSWERED_AFTER_POLLS = 2
# Load polls in a row that found the replica connected but got no answer within their
# timeout, after which it is unhealthy (one that cannot be reached is at once).
SLOW_POLLS_UNHEALTHY = 2


@dataclass
class Replica:
    address: str  # host:port
    model: str
    client: ReplicaClient
    capacity: int
    healthy: bool = True
    removed: bool = False  # left discovery (or its model did): closed once idle (reap)
    reports_draining: bool = False  # its last GetLoad said so (the replica got SIGTERM)
    waiting: int = 0  # from the last GetLoad
    running: int = 0
    kv_cache_usage: float = 0.0
    max_model_len: int = 0  # from GetLoad; 0 until the first poll answers
    failures: int = 0  # consecutive failed polls / calls
    lora_adapters: frozenset[str] = frozenset()  # served by name (GetLoad, or loaded here)
    max_loras: int = 0  # the replica's adapter slots (0: LoRA off)
    # Adapters this gateway is loading there now: requests for them wait for the one load.
    loading: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    @property
    def draining(self) -> bool:
        """Takes no new requests; those in flight finish (see the module docstring)."""
        return self.removed or self.reports_draining

    def adapters(self) -> frozenset[str]:
        """What routing counts as there: served, or being loaded by this gateway."""
        return self.lora_adapters.union(self.loading) if self.loading else self.lora_adapters


@dataclass
class Fleet:
    """Every model's replicas, and the gateway's exact in-flight count per replica."""

    slots: ReplicaSlots = field(default_factory=ReplicaSlots)
    replicas: dict[str, dict[str, Replica]] = field(default_factory=dict)  # model → address →
    on_change: Callable[[], None] | None = None  # capacity may have changed (admission.notify)
    # Requests held for a model without replicas (scale from zero), waiting for its first:
    # model → requests held now, never 0 (a removed model's count goes with its last one).
    held: dict[str, int] = field(default_factory=dict)
    _appeared: dict[str, asyncio.Event] = field(default_factory=dict, repr=False)
    # Replicas of removed models, (model, address) → replica; draining, like any other
    # replica that left discovery, so reap() closes each once its requests have finished.
    _retired: dict[tuple[str, str], Replica] = field(default_factory=dict, repr=False)
    # (model, address) of the replicas reap() forgot since the gauges last took them
    # (GatewayState.update_gauges drops their series).
    reaped: list[tuple[str, str]] = field(default_factory=list)

    # ---- membership -----------------------------------------------------------------
    def set_replicas(self, model: str, addresses: Iterable[str], capacity: int) -> None:
        """Make ``addresses`` the model's replicas: add new ones, drain removed ones."""
        wanted = list(dict.fromkeys(addresses))
        current = self.replicas.setdefault(model, {})
        for address in wanted:
            rep = current.get(address)
            if rep is None:
                current[address] = Replica(address, model, ReplicaClient(address), capacity)
                log.info("replica %s added for model %s", address, model)
            else:
                rep.capacity, rep.removed = capacity, False
        for address, rep in current.items():
            if address not in wanted and not rep.removed:
                rep.removed = True
                log.info(
                    "replica %s of model %s is draining (%d in flight)",
                    address, model, self.slots.in_flight(address),
                )  # fmt: skip
        if self.has_replicas(model) and (appeared := self._appeared.pop(model, None)):
            appeared.set()
        self._changed()

    def remove_model(self, model: str) -> None:
        """Stop serving ``model``: its replicas drain (closed by ``reap`` when idle), and
        requests held for its first replica stop waiting (``wait_for_replicas``)."""
        current = self.replicas.pop(model, None)
        if current is None:
            return
        for address, rep in current.items():
            rep.removed = True
            self._retired[model, address] = rep
        if appeared := self._appeared.pop(model, None):
            appeared.set()
        log.info("model %s removed; %d replica(s) draining", model, len(current))
        self._changed()  # queued requests for it fail at their next pick

    def has_replicas(self, model: str) -> bool:
        """Whether the model has a replica that discovery (or the config) lists, whatever
        its health: if not, it is scaled to zero or not started yet. (One that is listed
        but unhealthy or draining is a failure the client hears of at once, not a cold
        start to wait for: ``UpstreamCall``.)"""
        return any(not rep.removed for rep in self.replicas.get(model, {}).values())

    async def wait_for_replicas(self, model: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the model's first replica, or for the model's
        removal; False if neither happened in time.

        A request for a model scaled to zero waits here rather than in the admission
        queue: the queue admits in order and stops at a head that finds no slot, so a
        request that can wait a whole cold start would hold up every other model's."""
        if self.has_replicas(model):
            return True
        appeared = self._appeared.setdefault(model, asyncio.Event())
        self.held[model] = self.held.get(model, 0) + 1
        try:
            await asyncio.wait_for(appeared.wait(), timeout)
        except TimeoutError:
            return False
        finally:
            self.held[model] -= 1
            if not self.held[model]:
                del self.held[model]
        return True

    async def reap(self) -> None:
        """Close and forget replicas that left discovery and have nothing in flight (one
        draining of its own accord stays: it may come back)."""
        for table in self._tables():
            for key, rep in list(table.items()):
                if rep.removed and self.slots.in_flight(rep.address) == 0:
                    del table[key]
                    self.reaped.append((rep.model, rep.address))
                    await rep.client.close()
                    log.info("replica %s of model %s removed", rep.address, rep.model)

    # ---- what routers and metrics see ---------------------------------------------------
    def models(self) -> list[str]:
        return sorted(self.replicas)

    def views(self, model: str) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(
                address=rep.address,
                in_flight=self.slots.in_flight(rep.address),
                waiting=rep.waiting,
                running=rep.running,
                capacity=rep.capacity,
                healthy=rep.healthy,
                draining=rep.draining,
                adapters=rep.adapters(),
                lora_slots=rep.max_loras,
            )
            for rep in self.replicas.get(model, {}).values()
        ]

    def adapters(self, model: str) -> set[str]:
        """The LoRA adapters any of the model's replicas serves (or is loading)."""
        return {name for rep in self.replicas.get(model, {}).values() for name in rep.adapters()}

    def adapter_base(self, name: str) -> str | None:
        """The model one of whose replicas serves the adapter ``name`` (the first by name
        if several do)."""
        for model in sorted(self.replicas):
            if any(name in rep.adapters() for rep in self.replicas[model].values()):
                return model
        return None

    def get(self, model: str, address: str) -> Replica | None:
        return self.replicas.get(model, {}).get(address)

    def max_model_len(self, model: str) -> int | None:
        """The longest context among the model's replicas (None before any poll answered)."""
        lengths = [rep.max_model_len for rep in self.replicas.get(model, {}).values()]
        return max(lengths, default=0) or None

    # ---- health ------------------------------------------------------------------------
    def mark_failed(self, rep: Replica, why: str) -> None:
        rep.failures += 1
        if rep.healthy:
            rep.healthy = False
            log.warning("replica %s of model %s is unhealthy: %s", rep.address, rep.model, why)
            self._changed()

    def mark_ok(self, rep: Replica) -> None:
        rep.failures = 0
        if not rep.healthy:
            rep.healthy = True
            log.info("replica %s of model %s is healthy again", rep.address, rep.model)
            self._changed()

    def set_reports_draining(self, rep: Replica, draining: bool) -> None:
        """What the replica's last load report said of its own drain."""
        if draining == rep.reports_draining:
            return
        rep.reports_draining = draining
        if draining:
            log.info(
                "replica %s of model %s is draining (it said so; %d in flight)",
                rep.address, rep.model, self.slots.in_flight(rep.address),
            )  # fmt: skip
        else:
            log.info("replica %s of model %s takes requests again", rep.address, rep.model)
        self._changed()

    async def poll_once(self, timeout: float) -> None:
        """One round of ``GetLoad`` on every replica, concurrently."""
        reps = [rep for current in self.replicas.values() for rep in current.values()]
        results = await asyncio.gather(
            *(rep.client.get_load(timeout) for rep in reps), return_exceptions=True
        )
        for rep, res in zip(reps, results, strict=True):
            if isinstance(res, BaseException):
                why = f"GetLoad failed: {_failure(res)}"
                late = _timed_out(res)  # connected, but no answer in time
                if late and rep.healthy and rep.failures + 1 < SLOW_POLLS_UNHEALTHY:
                    rep.failures += 1  # late, not gone: healthy until the next one is late too
                    log.info("replica %s of model %s is slow: %s", rep.address, rep.model, why)
                    continue
                if not late:
                    # Unreachable: unhealthy, whatever it said before (a drained replica
                    # that has exited is down, not draining).
                    rep.reports_draining = False
                self.mark_failed(rep, why)
                self._give_up_unanswered(rep, why)
                continue
            self._read_load(rep, res)
            self.mark_ok(rep)
        await self.reap()
        self._changed()

    def _give_up_unanswered(self, rep: Replica, why: str) -> None:
        """Fail the requests open on ``rep`` that it has sent nothing yet, so that their
        calls retry them elsewhere (``kvserve.gateway.call``) rather than wait out their
        deadline: a replica that keeps its connection open while it answers nothing (a
        wedged engine, a stopped process) would hold them to it. A stream that has had
        output cannot move, and stays.

        Only after UNANSWERED_AFTER_POLLS failed polls in a row (one slow poll of a busy
        replica is no proof that it stopped), and only while another replica of the model
        can take them: with none, they are better off waiting where they are."""
        others = self.replicas.get(rep.model, {}).values()
        if rep.failures < UNANSWERED_AFTER_POLLS or not any(
            r is not rep and r.healthy and not r.draining for r in others
        ):
            return
        ended = rep.client.fail_unanswered(f"replica {rep.address} stopped answering ({why})")
        if ended:
            log.warning(
                "%d request(s) without output on unhealthy replica %s of model %s "
                "cancelled there, to be retried elsewhere",
                ended, rep.address, rep.model,
            )  # fmt: skip

    def _read_load(self, rep: Replica, load: Any) -> None:
        """Take a ``GetLoadResponse`` in: load figures, adapters, and whether it drains."""
        rep.waiting, rep.running = int(load.num_waiting), int(load.num_running)
        rep.kv_cache_usage = float(load.kv_cache_usage)
        rep.max_model_len = int(load.max_model_len)
        rep.lora_adapters = frozenset(load.lora_adapters)
        rep.max_loras = int(load.max_loras)
        self.set_reports_draining(rep, bool(load.draining))

    async def close(self) -> None:
        for table in self._tables():
            for rep in table.values():
                await rep.client.close()
        self.replicas.clear()
        self._retired.clear()

    def _tables(self) -> list[dict[Any, Replica]]:
        """Every replica, in its table: each model's by address, the retired ones."""
        return [*self.replicas.values(), self._retired]

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


def _timed_out(exc: BaseException) -> bool:
    """Whether a failed poll found the replica connected but without an answer in time."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return bool(exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
    return isinstance(exc, TimeoutError)


def _failure(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return str(exc.code().name)
    return type(exc).__name__
