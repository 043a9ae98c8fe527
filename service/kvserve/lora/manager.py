"""The engine's LoRA state: adapters in host memory, the device slots, and the layers.

Host memory holds, in LRU order, every adapter that a queued or running request needs
(those are never dropped) and up to ``max_cpu_loras`` idle ones besides those in device
slots; a further idle adapter evicts the least recently used. An adapter that is needed
again after it was dropped is read from its directory again; when that fails (the folder
was removed, or its files changed since), the adapter is *unreadable*: its requests are
refused (``AdapterUnreadableError``) without another read until it is removed, as the
server's unload or a load of the name again does. The device's
``max_loras`` slots are ``kvserve.lora.slots.SlotTable``'s; filling one copies the
adapter from host memory into the slot's tensors (``kvserve.lora.layers``).

Used from the engine's thread only (like the scheduler).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Hashable

from kvserve.lora.adapter import AdapterUnreadableError, LoRAError, LoRAWeights, load_adapter
from kvserve.lora.layers import LoRALayers
from kvserve.lora.request import LoRARequest
from kvserve.lora.slots import SlotTable
from kvserve.model.config import ModelConfig

log = logging.getLogger(__name__)

FORGOTTEN_MAX = 4096  # unloaded adapters' identities remembered (see LoRAManager.forgotten)


class LoRAManager:
    def __init__(
        self,
        model: ModelConfig,
        layers: LoRALayers,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
    ) -> None:
        self.model = model
        self.layers = layers
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        self.slots = SlotTable(max_loras, self._fill_slot)
        self.host: OrderedDict[LoRARequest, LoRAWeights] = OrderedDict()
        self.users: Counter[LoRARequest] = Counter()  # queued or running requests
        self.removed: set[LoRARequest] = set()  # unloaded, dropped once idle
        # Unloaded and dropped: never read again under that identity, though a request
        # that named it before the unload may still come (the server resolves names on
        # its event loop, the engine queues on its thread). Read then, the folder's
        # files (replaced, for a load in place) would run under the old identity, on
        # its cached KV. The newest FORGOTTEN_MAX are kept (a request outlives fewer).
        self.forgotten: OrderedDict[LoRARequest, None] = OrderedDict()
        self.disk_loads = 0  # adapters read from their directories (a statistic)
        # Each adapter's files as first read: one read again (after it left host memory)
        # from files that changed since is refused, not served under the old identity,
        # whose prefix-cache entries hold the old weights' KV.
        self.stamps: dict[LoRARequest, tuple[object, ...]] = {}
        # Adapters whose read-back failed. Never read again: files that come back (or
        # change back) are not known to be the ones first read. The server tests
        # membership from the event loop (one step for the interpreter) to stop serving them.
        self.unreadable: set[LoRARequest] = set()

    @property
    def capacity(self) -> int:
        """How many adapters stay in memory while idle: the slots' and the host copies'
        (what bounds the per-adapter metrics' cardinality)."""
        return self.slots.num_slots + self.max_cpu_loras

    def add(self, lora: LoRARequest) -> LoRAWeights:
        """The adapter's weights, read (and checked: ``LoRAError``) if not in host memory."""
        weights = self.host.get(lora)
        if weights is None:
            weights = self.put(self._read(lora))
            self.disk_loads += 1
        else:
            self.host.move_to_end(lora)
        return weights

    def is_unreadable(self, lora: LoRARequest) -> bool:
        return lora in self.unreadable

    def _read(self, lora: LoRARequest) -> LoRAWeights:
        """Read the adapter: the first time, any ``LoRAError`` is the adapter's own; read
        back (it was served before), a failure makes it unreadable."""
        if lora in self.unreadable:
            raise AdapterUnreadableError(lora)
        first = self.stamps.get(lora)
        try:
            read = load_adapter(lora, self.model, self.max_rank)
        except LoRAError as exc:
            if first is None:
                raise
            raise self._lose(lora, str(exc)) from None
        if first is not None and read.stamp != first:
            raise self._lose(lora, "its files changed since it was loaded")
        return read

    def _lose(self, lora: LoRARequest, why: str) -> AdapterUnreadableError:
        # The path goes to the server's log only: clients get the adapter's name.
        log.warning(
            "LoRA adapter %r (%s) can no longer be served, until it is loaded again: %s",
            lora.lora_name,
            lora.lora_path,
            why,
        )
        self.unreadable.add(lora)
        return AdapterUnreadableError(lora)

    def put(self, weights: LoRAWeights) -> LoRAWeights:
        """Keep adapter weights read elsewhere (the server reads them off the engine thread)."""
        self.host[weights.lora] = weights
        self.host.move_to_end(weights.lora)
        self.stamps.setdefault(weights.lora, weights.stamp)
        self._trim()
        return weights

    def load(self, lora: LoRARequest, weights: LoRAWeights | None = None) -> None:
        """Serve ``lora`` from now on (``LLMEngine.add_lora``): read it now, or keep
        ``weights`` read elsewhere; an unloaded identity loaded again is served again."""
        self.removed.discard(lora)
        self.forgotten.pop(lora, None)
        if weights is None:
            self.add(lora)
        else:
            self.put(weights)

    def remove(self, lora: LoRARequest) -> None:
        """Forget an unloaded adapter once nothing needs it (its requests finish first)."""
        if not self.users[lora] and self.slots.evict(lora):
            self.host.pop(lora, None)
            self.stamps.pop(lora, None)
            self.unreadable.discard(lora)
            self.removed.discard(lora)
            self.forgotten[lora] = None
            if len(self.forgotten) > FORGOTTEN_MAX:
                self.forgotten.popitem(last=False)
        else:
            self.removed.add(lora)

    def begin(self, lora: LoRARequest) -> None:
        """A request for ``lora`` is queued (reads the adapter if it is not in memory)."""
        if lora in self.forgotten:
            raise AdapterUnreadableError(
                lora,
                f"LoRA adapter {lora.lora_name!r} was unloaded or replaced while this "
                "request was on its way to the engine; send it again",
            )
        self.users[lora] += 1  # first, so that reading it cannot trim it away
        try:
            self.add(lora)
        except BaseException:
            self.end(lora)
            raise

    def end(self, lora: LoRARequest) -> None:
        """A request for ``lora`` finished or was aborted."""
        self.users[lora] -= 1
        if not self.users[lora]:
            del self.users[lora]
            if lora in self.removed and not self.slots.pinned(lora):
                self.remove(lora)
            self._trim()

    def slot(self, lora: LoRARequest | None) -> int:
        """The slot of a running request's adapter; -1 for the base model."""
        if lora is None:
            return -1
        slot = self.slots.slot_of(lora)
        assert slot is not None, f"adapter {lora.lora_name!r} runs but has no slot"
        return slot

    def adapter_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Names of the adapters with running requests, and of those with waiting ones
        (vLLM's ``running_lora_adapters`` and ``waiting_lora_adapters``: an adapter with
        both is in both, as there)."""
        # Copies first (each one step for the interpreter): GetLoad and /metrics read
        # this from another thread than the engine's.
        keys, pins, users = list(self.slots.keys), list(self.slots.pins), dict(self.users)
        running = {k: n for k, n in zip(keys, pins, strict=True) if k is not None and n}
        waiting = {k.lora_name for k, n in users.items() if n > running.get(k, 0)}
        names = {k.lora_name for k in running if isinstance(k, LoRARequest)}
        return tuple(sorted(names)), tuple(sorted(waiting))

    def _fill_slot(self, slot: int, key: Hashable) -> None:
        assert isinstance(key, LoRARequest)
        self.layers.load(slot, self.add(key))

    def _trim(self) -> None:
        resident = set(self.slots.resident)
        idle = [k for k in self.host if not self.users[k] and k not in resident]
        for lora in idle[: max(len(idle) - self.max_cpu_loras, 0)]:
            del self.host[lora]
