"""Where this process's tensor-parallel ranks run, and the worker processes of a node.

A group of ``tensor_parallel_size`` ranks spans ``nnodes`` nodes (pods) of
``tensor_parallel_size / nnodes`` ranks each; node ``r`` holds ranks
``[r·k, (r+1)·k)``. On node 0 the serving process is rank 0 (scheduler, sampler, API)
and starts ranks 1..k-1 as worker processes; another node's ``kvserve serve`` starts all
of its ranks as workers and serves only ``/health`` (``kvserve.parallel.node``).

The flags ``--nnodes/--node-rank/--master-addr/--master-port`` or a LeaderWorkerSet's
environment (``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``, ``LWS_LEADER_ADDRESS``) place
the node; with one node the group meets on a free loopback port.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from kvserve.config import EngineConfig

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500  # torch.distributed's customary rendezvous port
STOP_GRACE_SECONDS = 10.0  # for a worker to leave after the stop message, then SIGKILL


@dataclass(frozen=True)
class Launch:
    """This node's place in a multi-node group (all defaults: one node)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None with one node: a free port is chosen

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be ≥ 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port must be 1-65535, got {self.master_port}")

    @classmethod
    def resolve(
        cls,
        nnodes: int | None = None,
        node_rank: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        env: Mapping[str, str] = os.environ,
    ) -> Launch:
        """The flags, else a LeaderWorkerSet's environment, else one node."""

        def env_int(name: str) -> int | None:
            value = env.get(name)
            if value is None:
                return None
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None

        nnodes = nnodes if nnodes is not None else env_int("LWS_GROUP_SIZE") or 1
        node_rank = node_rank if node_rank is not None else env_int("LWS_WORKER_INDEX") or 0
        master_addr = master_addr or env.get("LWS_LEADER_ADDRESS") or "127.0.0.1"
        if master_port is None and nnodes > 1:
            master_port = DEFAULT_MASTER_PORT
        return cls(nnodes, node_rank, master_addr, master_port)

    def node_ranks(self, tensor_parallel_size: int) -> range:
        """The ranks this node runs."""
        if tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} does not split over "
                f"--nnodes {self.nnodes}: it must be a multiple of it"
            )
        k = tensor_parallel_size // self.nnodes
        return range(self.node_rank * k, (self.node_rank + 1) * k)

    def with_port(self) -> Launch:
        """This launch with a rendezvous port: a free loopback one if none was given."""
        if self.master_port is not None:
            return self
        with socket.socket() as s:
            s.bind((self.master_addr, 0))
            port: int = s.getsockname()[1]
        return Launch(self.nnodes, self.node_rank, self.master_addr, port)


def cpu_threads_per_rank(ranks_on_node: int) -> int:
    """On a CPU, this node's cores shared evenly by its ranks (at least one each): ranks
    with a thread team each over all cores would oversubscribe them."""
    return max(1, len(os.sched_getaffinity(0)) // ranks_on_node)


class LocalWorkers:
    """This node's worker processes (``python -m kvserve.parallel.worker``), one per rank.

    A watcher thread per process calls ``on_lost(why)`` when one exits before ``stop()``:
    the engine then fails the replica (docs/engine.md, "Tensor parallelism"). Each worker
    also leaves when this process is gone (``worker.exit_with_parent``), so none is
    left behind."""

    def __init__(
        self,
        config: EngineConfig,
        launch: Launch,
        ranks: range,
        tensor_parallel_size: int,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        """Start ``ranks`` (this node's, less rank 0 on node 0)."""
        node_ranks = launch.node_ranks(tensor_parallel_size)
        self.on_lost = on_lost
        self._stopping = False
        payload = json.dumps(asdict(config))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for rank in ranks:
            argv = [
                sys.executable,
                "-m",
                "kvserve.parallel.worker",
                "--rank",
                str(rank),
                "--size",
                str(tensor_parallel_size),
                "--ranks-on-node",
                str(len(node_ranks)),
                "--master-addr",
                launch.master_addr,
                "--master-port",
                str(launch.master_port),
            ]
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, close_fds=True)
            assert proc.stdin is not None
            proc.stdin.write(payload.encode())
            proc.stdin.close()
            self.procs[rank] = proc
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tp-worker-{rank}", daemon=True
            ).start()
        log.info("started tensor-parallel workers: ranks %s", list(ranks))

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._stopping or code == 0:  # 0: rank 0 stopped the group
            return
        why = _exit_message(rank, proc.pid, code)
        log.error("%s; the replica cannot serve without it", why)
        if self.on_lost is not None:
            self.on_lost(why)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def exited(self) -> str | None:
        """Why a worker has exited, if one has (before the group formed, any exit is)."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return _exit_message(rank, proc.pid, code)
        return None

    def wait(self) -> None:
        """Until every worker has exited."""
        for proc in self.procs.values():
            proc.wait()

    def failed(self) -> bool:
        """Whether a worker exited with a status other than 0."""
        return any(p.poll() not in (None, 0) for p in self.procs.values())

    def terminate(self) -> None:
        """Kill the workers still running (they ignore SIGTERM and SIGINT, which a signal
        to the whole process group would bring them during rank 0's drain), and wait."""
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        self.stop()

    def stop(self, timeout: float = STOP_GRACE_SECONDS) -> None:
        """Wait for the workers to leave (after the stop message), then kill the rest."""
        self._stopping = True
        for proc in self.procs.values():
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()


def _exit_message(rank: int, pid: int, code: int) -> str:
    return f"tensor-parallel worker rank {rank} (pid {pid}) exited with {_status(code)}"


def _status(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"status {code}"
