"""One process's membership in a tensor-parallel group, over ``torch.distributed``.

Two process groups join the same ranks:

- the *model* group (NCCL on CUDA, gloo on CPU) carries the forward pass's all-reduces
  and the logits' gather;
- the *control* group (always gloo, on the CPU) carries rank 0's per-step broadcast of
  the model input to the workers, as pickled objects.

Every collective here that fails (a peer died: gloo and NCCL see its sockets close; or a
peer hung past the group's timeout) raises ``GroupFailedError``, which the engine treats
as fatal for the whole replica (docs/engine.md, "Tensor parallelism").
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported from C

from kvserve.parallel.shard import TensorShard

log = logging.getLogger(__name__)

# A forward pass's collectives wait for the slowest rank, which does the same work: a
# peer silent this long is hung. The control group's broadcast also waits while rank 0
# is idle, so it may wait much longer (the async engine sends a keepalive meanwhile).
MODEL_TIMEOUT = datetime.timedelta(minutes=5)
CONTROL_TIMEOUT = datetime.timedelta(days=7)


class GroupFailedError(RuntimeError):
    """A collective failed: a rank of the tensor-parallel group died or hung."""


class TensorGroup:
    """The collectives of one rank (``shard``); rank 0 leads."""

    def __init__(self, shard: TensorShard, control: Any, model: Any) -> None:
        self.shard = shard
        self._control = control
        self._model = model

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    @classmethod
    def join(
        cls,
        rank: int,
        size: int,
        master_addr: str,
        master_port: int,
        device: torch.device,
        gone: Callable[[], str | None] = lambda: None,
    ) -> TensorGroup:
        """Join (rank 0: open) the group at ``master_addr:master_port``; blocks until all
        ``size`` ranks have joined. Rank 0 asks ``gone()`` while it waits: a reason (a
        worker it started has exited) ends the wait with ``GroupFailedError`` at once,
        where torch's rendezvous would wait out its timeout for a rank that never comes."""
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group: one "
                "tensor-parallel engine per process"
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's communicator binds to the current GPU
        log.info("rank %d/%d joining %s at %s:%d", rank, size, backend, master_addr, master_port)
        store = _rendezvous(rank, size, master_addr, master_port, gone)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=size, timeout=MODEL_TIMEOUT
        )
        model = dist.group.WORLD
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        return cls(TensorShard(rank, size), control, model)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Our references were the groups' last: dropped here, gloo's threads and the
        # rendezvous store are torn down now, not by the interpreter's finalization,
        # where a C++ destructor that needs the GIL can abort the process (SIGABRT,
        # "terminate called without an active exception", seen once at a shutdown).
        self._control = self._model = None

    # ---- the forward pass's collectives (model group) ------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        _checked(lambda: dist.all_reduce(x, group=self._model))
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0: the ranks' vocabulary slices side by side, cut to ``vocab_size``
        columns. Other ranks: ``local`` (they sample nothing)."""
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        _checked(lambda: dist.gather(local.contiguous(), parts, dst=0, group=self._model))
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value``s, known to every rank."""
        t = torch.tensor([value], dtype=torch.long)
        _checked(lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control))
        return int(t.item())

    # ---- the step loop (control group) ---------------------------------------------------
    def broadcast(self, message: object | None = None) -> Any:
        """Rank 0 sends ``message`` (tensors in it travel as CPU copies); the others
        receive and return it."""
        box = [_map_tensors(message, lambda t: t.cpu()) if self.rank == 0 else None]
        _checked(lambda: dist.broadcast_object_list(box, src=0, group=self._control))
        return box[0]


JOINED_KEY = "kvserve/joined"  # the rendezvous store's count of the workers that came
JOIN_POLL_SECONDS = 0.05


def _rendezvous(
    rank: int, size: int, master_addr: str, master_port: int, gone: Callable[[], str | None]
) -> Any:
    """The group's store (rank 0 serves it), once every rank has reached it."""
    if rank != 0:
        store = TCPStore(master_addr, master_port, size, is_master=False, timeout=MODEL_TIMEOUT)
        store.add(JOINED_KEY, 1)
        return store
    try:
        store = TCPStore(
            master_addr, master_port, size, is_master=True, timeout=MODEL_TIMEOUT,
            wait_for_workers=False,
        )  # fmt: skip
    except dist.DistNetworkError as exc:  # the port is taken, or the address is not this host's
        reason = str(exc).rpartition("message: ")[2] or str(exc)
        raise ValueError(
            f"the tensor-parallel rendezvous cannot listen on {master_addr}:{master_port} "
            f"(--master-addr, --master-port): {reason}"
        ) from None
    deadline = time.monotonic() + MODEL_TIMEOUT.total_seconds()
    while (joined := store.add(JOINED_KEY, 0)) < size - 1:
        if (why := gone()) is not None:
            raise GroupFailedError(f"the group cannot form: {why}")
        if time.monotonic() > deadline:
            raise GroupFailedError(
                f"the group cannot form: {joined} of {size - 1} workers joined at "
                f"{master_addr}:{master_port} within {MODEL_TIMEOUT}"
            )
        time.sleep(JOIN_POLL_SECONDS)  # a poll: the store offers no wait with a way out
    return store


def to_device(message: Any, device: torch.device) -> Any:
    """``message`` with every tensor in it moved to ``device``."""
    return _map_tensors(message, lambda t: t.to(device))


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to each tensor in it (through dataclasses, lists,
    tuples and dicts)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, list):
        return [_map_tensors(x, fn) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _checked(op: Callable[[], object]) -> None:
    try:
        op()
    except GroupFailedError:
        raise
    except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection, or a timeout
        raise GroupFailedError(f"tensor-parallel collective failed: {exc}") from exc
