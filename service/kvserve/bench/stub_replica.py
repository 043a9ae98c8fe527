"""A stand-in replica for measuring the gateway alone: the engine's gRPC API with canned
output and no model (docs/bench-methods.md, "kvserve bench gateway"). A prompt
``stub:error:CODE`` is answered with the engine's ``Error`` of gRPC status CODE (e.g.
``INTERNAL``), as a replica answers a request that failed there; ``stub:late-error:CODE``
gets one token first (a request that fails mid-generation)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvserve.bench.sse_client import run_on_uvloop
from kvserve.config import DEFAULT_BLOCK_SIZE
from kvserve.rpc import codec
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from kvserve.rpc.listen import bind, server_options

TOKEN_ID = 42
TOKEN_TEXT = " word"
DEFAULT_MAX_TOKENS = 16  # the engine's default for a request without max_tokens
ERROR_PROMPT = "stub:error:"
LATE_ERROR_PROMPT = "stub:late-error:"


def _prompt_tokens(start: pb.GenerateRequest) -> int:
    """A plausible prompt length for the usage the gateway settles limits with."""
    kind = start.WhichOneof("prompt")
    if kind == "prompt_token_ids":
        return len(start.prompt_token_ids.ids)
    if kind == "chat":
        return sum(len(m.content.split()) + 4 for m in start.chat.messages)
    return len(start.prompt_text.split())


@dataclass(slots=True)
class _Open:
    max_tokens: int
    prompt_tokens: int
    done: int = 0  # tokens sent
    error: pb.Error | None = None  # sent after the first token


class StubEngine(pb_grpc.EngineServiceServicer):
    def __init__(self, step_seconds: float) -> None:
        self.step_seconds = step_seconds

    async def GetLoad(self, request: Any, context: Any) -> pb.GetLoadResponse:
        return pb.GetLoadResponse(
            block_size=DEFAULT_BLOCK_SIZE, num_blocks=1 << 16, num_free_blocks=1 << 16
        )

    async def Health(self, request: Any, context: Any) -> pb.HealthResponse:
        return pb.HealthResponse(serving=True)

    async def GenerateMany(
        self, request_iterator: AsyncIterator[pb.GenerateManyRequest], context: Any
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        open_: dict[int, _Open] = {}
        ended: list[pb.TaggedOutput] = []  # cancelled requests' finals, sent with the next step
        work = asyncio.Event()

        async def read_commands() -> None:
            async for message in request_iterator:
                for command in message.commands:
                    if command.WhichOneof("kind") == "start":
                        start = command.start  # max_tokens unset reads 0
                        if start.prompt_text.startswith(ERROR_PROMPT):
                            code = grpc.StatusCode[start.prompt_text[len(ERROR_PROMPT) :]]
                            error = codec.encode_error(code, f"the stub answers {code.name}")
                            ended.append(pb.TaggedOutput(tag=command.tag, error=error))
                            continue
                        max_tokens = start.max_tokens or DEFAULT_MAX_TOKENS
                        req = open_[command.tag] = _Open(max_tokens, _prompt_tokens(start))
                        if start.prompt_text.startswith(LATE_ERROR_PROMPT):
                            code = grpc.StatusCode[start.prompt_text[len(LATE_ERROR_PROMPT) :]]
                            req.error = codec.encode_error(code, f"the stub answers {code.name}")
                    elif open_.pop(command.tag, None) is not None:
                        final = pb.Final(finish_reason="abort", usage=pb.Usage())
                        ended.append(pb.TaggedOutput(tag=command.tag, final=final))
                work.set()

        reader = asyncio.create_task(read_commands())
        try:
            while not reader.done() or open_ or ended:
                if not open_ and not ended:
                    work.clear()
                    waiter = asyncio.ensure_future(work.wait())
                    await asyncio.wait((waiter, reader), return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    continue
                await asyncio.sleep(self.step_seconds)
                outputs, ended = ended, []
                for tag, req in list(open_.items()):
                    delta = pb.Delta(token_ids=[TOKEN_ID], text=TOKEN_TEXT)
                    outputs.append(pb.TaggedOutput(tag=tag, delta=delta))
                    req.done += 1
                    if req.error is not None:
                        del open_[tag]
                        outputs.append(pb.TaggedOutput(tag=tag, error=req.error))
                    elif req.done >= req.max_tokens:
                        del open_[tag]
                        usage = pb.Usage(
                            prompt_tokens=req.prompt_tokens, completion_tokens=req.done
                        )
                        final = pb.Final(finish_reason="length", usage=usage)
                        outputs.append(pb.TaggedOutput(tag=tag, final=final))
                if outputs:
                    yield pb.GenerateManyResponse(outputs=outputs)
        finally:
            reader.cancel()


async def serve(host: str, port: int, step_seconds: float) -> None:
    server = grpc.aio.server(options=server_options())
    pb_grpc.add_EngineServiceServicer_to_server(StubEngine(step_seconds), server)
    bind(server, host, port)
    await server.start()
    print(f"stub replica on {host}:{port}, a step every {step_seconds * 1e3:g} ms", flush=True)
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.bench.stub_replica", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--step-ms", type=float, default=1.0, help="time between output messages")
    args = p.parse_args(argv)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            run_on_uvloop(serve(args.host, args.port, args.step_ms / 1e3))
    except OSError as exc:  # the port is taken
        raise SystemExit(f"stub replica: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
