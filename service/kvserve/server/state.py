"""What the routes share: the engine, the served model's name, telemetry."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from kvserve.engine.async_engine import AsyncEngine
from kvserve.openai.chat_output import ChatParsing
from kvserve.openai.stalls import DEFAULT_WRITE_STALL_SECONDS
from kvserve.sampling_params import StopLimits
from kvserve.server.lora import LoRAAdapters
from kvserve.telemetry.prometheus import EngineMetrics
from kvserve.telemetry.tracing import RequestTelemetry


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    metrics: EngineMetrics
    telemetry: RequestTelemetry
    lora: LoRAAdapters  # the base model and the LoRA adapters, by name (kvserve.server.lora)
    stop_limits: StopLimits = field(default_factory=StopLimits)
    # A stream whose client has not read for this long is ended (kvserve.openai.stalls).
    write_stall_timeout: float = DEFAULT_WRITE_STALL_SECONDS
    admitting: bool = True  # false while draining: readiness fails, new requests get 503
    # API requests taken in and not yet answered or streaming (their body read, prompts
    # tokenized, a template rendered, a grammar compiled; a whole answer until it is
    # sent): a drain waits for them as for the engine's requests.
    preparing: int = 0
    # How a chat answer is read: tool calls and reasoning (--tool-call-parser, --reasoning-parser).
    chat_parsing: ChatParsing = field(default_factory=ChatParsing)
    # /v1/models' ``created`` (Unix seconds): when this server started serving the model.
    created: int = field(default_factory=lambda: int(time.time()))

    @contextmanager
    def prepared(self) -> Iterator[None]:
        """Count a request as ``preparing`` while the block runs (up to its submission)."""
        self.preparing += 1
        try:
            yield
        finally:
            self.preparing -= 1

    @property
    def in_flight(self) -> int:
        """What a drain waits for: the engine's requests and those on their way to it."""
        return self.engine.num_in_flight + self.preparing

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvserve
    return state


async def get_state(request: Request) -> ServerState:
    # async: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop
    # (and a GIL hand-off) on every request.
    return server_state(request)


State = Annotated[ServerState, Depends(get_state)]
