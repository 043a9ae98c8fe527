"""A replica that takes a request and then answers nothing, while its gRPC connection
stays open (a wedged engine or event loop): ``GetLoad`` answers until the first request
arrives and hangs after it, and ``GenerateMany`` never sends an output. It prints each
command it receives (``start <tag>``, ``cancel <tag>``) to its log, where a test can see
what the gateway sent it. Run as ``python -m tests.support.wedged_replica --port N``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from tests.support.net import free_port
from tests.support.processes import LoggedProcess, start_logged
from tests.support.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


class WedgedEngine(pb_grpc.EngineServiceServicer):
    def __init__(self) -> None:
        self.wedged = asyncio.Event()  # a request has arrived: nothing answers from now

    async def GetLoad(self, request: Any, context: Any) -> pb.GetLoadResponse:
        if self.wedged.is_set():
            await asyncio.Event().wait()  # never
        return pb.GetLoadResponse()

    async def GenerateMany(
        self, request_iterator: AsyncIterator[pb.GenerateManyRequest], context: Any
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        async for message in request_iterator:
            for command in message.commands:
                print(command.WhichOneof("kind"), command.tag, flush=True)
            self.wedged.set()
        await asyncio.Event().wait()  # the call stays open, silent
        yield pb.GenerateManyResponse()  # never reached: makes this a stream handler


async def serve(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_EngineServiceServicer_to_server(WedgedEngine(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("listening", flush=True)
    await server.wait_for_termination()


@contextmanager
def wedged_replica() -> Iterator[tuple[str, LoggedProcess]]:
    """The replica's ``host:port`` and its process (whose ``log`` holds the commands it
    received) while the block runs."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.support.wedged_replica", "--port", str(port)]
    proc = start_logged(argv, "wedged-replica", cwd=REPO_ROOT)
    try:
        wait_until(lambda: _listening(proc), timeout=60)
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.stop()


def _listening(proc: LoggedProcess) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"the wedged replica exited\n{proc.tail()}")
    return "listening" in proc.log.read_text()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.support.wedged_replica")
    p.add_argument("--port", type=int, required=True)
    asyncio.run(serve(p.parse_args(argv).port))


if __name__ == "__main__":
    main()
