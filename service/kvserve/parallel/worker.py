"""A tensor-parallel worker rank: ``python -m kvserve.parallel.worker``.

It loads its slice of the model, sizes its KV cache with the other ranks (the smallest
pool wins), then runs each step rank 0 broadcasts, until rank 0 sends the stop message.
A failed collective (rank 0 or another worker died) ends it with status 1. It ignores
SIGINT and SIGTERM (see ``main``). The
``EngineConfig`` arrives as JSON on stdin (``launch.LocalWorkers``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from kvserve.config import EngineConfig
from kvserve.parallel.group import GroupFailedError
from kvserve.parallel.launch import cpu_threads_per_rank

PARENT_CHECK_SECONDS = 1.0


def serve_rank(
    config: EngineConfig, rank: int, size: int, ranks_on_node: int, master_addr: str, port: int
) -> None:
    """Run rank ``rank`` of ``size`` until rank 0 stops the group."""
    import torch

    from kvserve.engine.llm_engine import ModelSetup
    from kvserve.parallel.group import TensorGroup

    setup = ModelSetup.resolve(config, rank)
    if setup.device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(ranks_on_node))
    group = TensorGroup.join(rank, size, master_addr, port, setup.device)
    try:
        runner = setup.runner(config, group)
        runner.allocate_kv_cache(group.min_int(setup.kv_pool_blocks(config, runner.config)))
        while (message := group.broadcast()) is not None:
            runner.follow(message)
    finally:
        group.close()


def exit_with_parent(interval: float = PARENT_CHECK_SECONDS) -> None:
    """Exit (status 1) once the process that started this one is gone: a worker waiting
    at the rendezvous or loading would otherwise outlive a crashed server. (Not
    PR_SET_PDEATHSIG: it fires when the *thread* that started the child ends.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)  # polling: Linux offers no wait on a non-child
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.parallel.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--ranks-on-node", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s %(message)s",
    )
    exit_with_parent()
    # A signal to the server's whole process group (Ctrl-C in a terminal, a service
    # manager stopping the group) must not take a rank from under rank 0's drain: a
    # worker leaves on rank 0's stop message, when its parent is gone, or when killed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = EngineConfig(**json.loads(sys.stdin.read()))
    try:
        serve_rank(
            config, args.rank, args.size, args.ranks_on_node, args.master_addr, args.master_port
        )
    except GroupFailedError as exc:
        logging.getLogger("kvserve.parallel").error("rank %d leaves: %s", args.rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
