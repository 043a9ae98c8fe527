"""The gateway's side of the engine's gRPC API: one client per replica, and the mapping
from an OpenAI request onto ``GenerateRequest``.

Sampling values are validated here with the engine's own ``SamplingParams`` (so a bad
value is a 400 at the gateway, named like the engine names it) and then sent field by
field; the engine validates again, which costs nothing and keeps each side honest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from kvserve.gateway.multiplex import Multiplexer, UpstreamRequest
from kvserve.outputs import TokenLogprob
from kvserve.sampling_params import SamplingParams
from kvserve.server.grpc import engine_pb2 as pb
from kvserve.server.grpc import engine_pb2_grpc as pb_grpc

# Keep idle connections warm through load balancers and notice dead replicas quickly
# (the replica's server accepts pings this often: kvserve.server.grpc.service).
KEEPALIVE_TIME_MS = 30_000


def _channel_options(keepalive_ms: int) -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ]


def generate_request(
    request_id: str,
    prompt: str | list[int] | list[dict[str, str]],
    params: SamplingParams,
    *,
    max_tokens_set: bool = True,
    cache_salt: str | None = None,
) -> pb.GenerateRequest:
    """``GenerateRequest`` for ``prompt`` (text, token ids, or chat messages).

    ``max_tokens_set=False`` leaves ``max_tokens`` unset, so the engine gives a chat as many
    tokens as its context leaves (the OpenAI default when the client sets no limit).
    """
    req = pb.GenerateRequest(
        request_id=request_id,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
    )
    if max_tokens_set:
        req.max_tokens = params.max_tokens
    if params.seed is not None:
        req.seed = params.seed
    if params.logprobs is not None:
        req.logprobs = params.logprobs
    if cache_salt is not None:
        req.cache_salt = cache_salt
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif prompt and isinstance(prompt[0], dict):
        messages = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt]  # type: ignore[index]
        req.chat.CopyFrom(pb.ChatMessages(messages=messages))
    else:
        req.prompt_token_ids.CopyFrom(pb.TokenIds(ids=prompt))  # type: ignore[arg-type]
    return req


@dataclass
class DeltaLogprobs:
    """A delta's logprob entries and the texts of their tokens (the gateway has no tokenizer)."""

    entries: list[TokenLogprob]
    texts: dict[int, str]

    def token_text(self, token_id: int) -> str:
        return self.texts.get(token_id, str(token_id))


def delta_logprobs(delta: Any) -> DeltaLogprobs | None:
    """The logprobs carried by a ``Delta`` (None when the request asked for none)."""
    if not delta.logprobs:
        return None
    entries: list[TokenLogprob] = []
    texts: dict[int, str] = {}
    for lp in delta.logprobs:
        # A protobuf map has no order: most likely first, as the engine lists them.
        top = dict(sorted(lp.top.items(), key=lambda item: -item[1]))
        entries.append(TokenLogprob(lp.token_id, lp.logprob, top))
        texts[lp.token_id] = lp.token
        texts.update(lp.top_tokens)
    return DeltaLogprobs(entries, texts)


class ReplicaClient:
    """A channel to one engine replica (``host:port``) and the calls the gateway makes.

    Requests share one ``GenerateMany`` call (``kvserve.gateway.multiplex``).
    """

    def __init__(self, address: str, keepalive_ms: int = KEEPALIVE_TIME_MS) -> None:
        self.address = address
        options = _channel_options(keepalive_ms)
        self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = pb_grpc.EngineServiceStub(self._channel)
        self._requests = Multiplexer(self._stub, address)

    def generate(
        self, request: pb.GenerateRequest, timeout: float, metadata: Mapping[str, str]
    ) -> UpstreamRequest:
        """Start ``request`` on the shared call; ``cancel()`` the result to abort it."""
        return self._requests.start(request, timeout, metadata)

    async def get_load(self, timeout: float) -> Any:
        return await self._stub.GetLoad(pb.GetLoadRequest(), timeout=timeout)

    async def close(self) -> None:
        self._requests.close()
        await self._channel.close()
