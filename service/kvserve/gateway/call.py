"""One request's trip to the replicas: a slot, the upstream call, retries, and cleanup.

Before the first output the request may be retried on another replica; after it, never.
A request waits in the admission queue only while some replica of its model could take
it once a slot frees; when none can (each is unhealthy, draining, or already tried) it
is refused at once with 503 ``no_healthy_replica`` rather than at the queue timeout.
A request for ``n`` samples is ``n`` upstream requests to one replica, started together
(the response starts once each has its first output, so a retry moves them all) and
ended together.
A request for a LoRA adapter routed to a replica that does not serve it has the replica
load it first (``kvserve.gateway.adapters``).
What a failure upstream means (the request's, the replica's or the clock's) and what the
client gets is ``kvserve.gateway.failures``; only a replica's failure marks it unhealthy.
``request_timeout_seconds`` counts from the request's arrival: the queue, retries and the
answer all fit in it.
``UpstreamCall.close`` runs exactly once, whatever ended the request, and settles its
slot, its token reservation, its metrics and its span. Turning the replica's messages
into the client's response is ``kvserve.gateway.relay``'s job.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Collection, Sequence
from typing import Any

import grpc
from opentelemetry import trace

from kvserve.gateway import adapters
from kvserve.gateway.admission import AdmissionRejected, QueueFull, QueueTimeout, Slot
from kvserve.gateway.auth import Tenant
from kvserve.gateway.failures import (
    adapter_gone,
    client_error,
    no_healthy_replica,
    queue_refusal,
    refused,
    replica_broken,
    timed_out,
)
from kvserve.gateway.ratelimit import Admission
from kvserve.gateway.replicas import Replica
from kvserve.gateway.routing import ReplicaLoad
from kvserve.gateway.state import GatewayState
from kvserve.openai.errors import OpenAIError


class UpstreamCall:
    """One request's upstream life (see the module docstring)."""

    def __init__(
        self,
        state: GatewayState,
        model: str,
        tenant: Tenant,
        admission: Admission,
        span: trace.Span,
        s: float,
        prompt_estimate: int,
        adapter: str | None = None,
        samples: int = 1,
    ) -> None:
        # ``model`` is the served model (whose replicas and metrics these are); ``adapter``
        # the LoRA adapter of it that the request named, if any.
        self.state, self.model, self.tenant = state, model, tenant
        self.adapter = adapter
        self.admission, self.span, self.s = admission, span, s
        self.deadline = s + state.config.request_timeout_seconds  # on time.monotonic()
        self.prompt_estimate = prompt_estimate
        self.samples = samples  # per prompt (n): the upstream requests are prompts × n
        self.output_tokens = 0  # seen so far (charged if the request never finishes)
        self.prompt_tokens: dict[int, int] = {}  # by sample, as its replica counted them
        self.slot: Slot | None = None
        self.grpc_calls: list[Any] = []  # one per sample
        self.replica: Replica | None = None
        self.f: float | None = None  # first chunk with text handed to the client
        self.e: float | None = None  # last one
        self.usage_tokens = 0
        self.finals: dict[int, Any] = {}  # each finished sample's Final
        self.status = 200
        self.done = False  # every sample has finished
        self.closed = False

    # ---- before the first token: route, queue, call, retry --------------------------
    async def start(self, key: str, requests: list[Any], metadata: dict[str, str]) -> list[Any]:
        """The replica's first response message for each of ``requests`` (the samples);
        retries on other replicas until one answers them all (or raises the OpenAIError
        the client gets)."""
        st = self.state
        cfg = st.config
        exclude: set[str] = set()
        last_error = "no replica answered"
        try:
            held = await self._hold()
        except AdmissionRejected as exc:
            raise self._rejected(exc) from None
        for attempt in range(cfg.retry.max_attempts):
            if attempt:
                st.metrics.retries.labels(self.model).inc()
            decisions: list[Any] = []
            pick = functools.partial(self._pick, key, exclude, decisions)
            # Also checked by pick(), but that runs only once this request heads its
            # model's waiters: behind them it would wait for nothing.
            self._check_routable(st.fleet.views(self.model), exclude, last_error if attempt else "")
            try:
                self.slot = await st.queue.acquire(
                    self.tenant.name, self.tenant.priority, pick, pool=self.model, held=held
                )
                held = 0.0  # a retry's wait is its own
            except AdmissionRejected as exc:
                raise self._rejected(exc) from None
            decision = decisions[-1]
            st.metrics.routing.labels(self.model, cfg.routing.policy, decision.address).inc()
            if decision.overridden or attempt:
                st.metrics.overrides.labels(self.model).inc()
            self.replica = st.fleet.get(self.model, self.slot.address)
            if self.replica is None:  # removed while we waited
                self._release_slot()
                continue
            self.span.set_attribute("kvserve.replica", self.replica.address)
            # A replica routed to for an adapter it does not serve yet: the router asked
            # for a load (decision.load_adapter), or another request's load is under way.
            if self.adapter is not None and self.adapter not in self.replica.lora_adapters:
                try:
                    await adapters.ensure_loaded(
                        st, self.model, self.replica, self.adapter, self._time_left()
                    )
                except adapters.AdapterLoadFailed as exc:
                    self._release_slot()
                    if exc.code == grpc.StatusCode.UNAVAILABLE:
                        st.fleet.mark_failed(self.replica, str(exc))
                    exclude.add(self.replica.address)
                    last_error = str(exc)
                    continue
            client = self.replica.client
            timeout = self._time_left()
            self.grpc_calls = [client.generate(r, timeout, metadata) for r in requests]
            firsts = await asyncio.gather(*map(_first_message, self.grpc_calls))
            failed = [m for m in firsts if isinstance(m, grpc.aio.AioRpcError) or m is grpc.aio.EOF]
            if not failed:
                st.fleet.mark_ok(self.replica)
                # A replica's first delta of each sample holds its prompt's length
                # (charged if the request ends before its usage comes).
                self.prompt_tokens = {
                    i: m.delta.prompt_tokens
                    for i, m in enumerate(firsts)
                    if m.WhichOneof("kind") == "delta" and m.delta.HasField("prompt_tokens")
                }
                return firsts
            for upstream in self.grpc_calls:  # the samples move together
                upstream.cancel()
            first = failed[0]
            code = first.code() if isinstance(first, grpc.aio.AioRpcError) else None
            detail = first.details() if isinstance(first, grpc.aio.AioRpcError) else "empty"
            self._release_slot()
            if isinstance(first, grpc.aio.AioRpcError) and (error := refused(first)):
                # The client's error, which the replica found: not a failed call to it.
                st.metrics.rejections.labels("invalid").inc()
                raise error
            st.metrics.upstream_errors.labels(self.model, code.name if code else "EOF").inc()
            is_error = isinstance(first, grpc.aio.AioRpcError)
            if self.adapter is not None and is_error and adapter_gone(first):
                # Unloaded there since the last poll, or its files are gone there: the
                # replica is fine, and another one may serve the adapter.
                adapters.forget(self.replica, self.adapter)
                exclude.add(self.replica.address)
                last_error = f"replica {self.replica.address}: {detail}"
                continue
            if isinstance(first, grpc.aio.AioRpcError) and not replica_broken(first):
                raise client_error(first, cfg.request_timeout_seconds)
            st.fleet.mark_failed(self.replica, f"{code.name if code else 'EOF'}: {detail}")
            exclude.add(self.replica.address)
            last_error = f"replica {self.replica.address}: {detail}"
        raise OpenAIError(502, f"no replica could serve the request ({last_error})")

    async def _hold(self) -> float:
        """Seconds held for the model's first replica: none while it has one; else (it is
        scaled to zero) up to the queue timeout, counted in ``held_requests`` so the
        operator scales it up. Raises what the admission queue would: ``QueueFull`` or
        ``QueueTimeout``."""
        st = self.state
        if st.fleet.has_replicas(self.model):
            return 0.0
        admission = st.config.admission
        retry_after = st.queue.retry_after
        if sum(st.fleet.held.values()) + st.queue.queue_length >= admission.queue_size:
            raise QueueFull(
                f"admission queue full ({admission.queue_size} waiting)",
                reason="full",
                retry_after=retry_after,
            )
        started = time.monotonic()
        self.span.add_event("held: the model has no replica")
        if not await st.fleet.wait_for_replicas(self.model, admission.queue_timeout_seconds):
            raise QueueTimeout(
                f"no replica of {self.model!r} came up within "
                f"{admission.queue_timeout_seconds:g} s",
                reason="timeout",
                retry_after=retry_after,
            )
        self._check_served()
        return time.monotonic() - started

    def _time_left(self) -> float:
        """Seconds left of ``request_timeout_seconds``; 504 when none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise timed_out(self.state.config.request_timeout_seconds)
        return left

    def _check_served(self) -> None:
        """404 ``model_not_found`` if the model was removed while the request waited."""
        if not self.state.serves(self.model):
            raise OpenAIError(
                404,
                f"model {self.model!r} was removed while the request waited for a replica",
                param="model",
                code="model_not_found",
            )

    def _rejected(self, exc: AdmissionRejected) -> OpenAIError:
        """The 503 a client gets when admission refuses it (counted by reason)."""
        error = queue_refusal(exc)
        self.state.metrics.rejections.labels(error.code).inc()
        return error

    def _check_routable(
        self, views: Sequence[ReplicaLoad], exclude: Collection[str], last_error: str = ""
    ) -> None:
        """503 ``no_healthy_replica`` unless a replica of the model could take the request
        once it has a free slot: a busy replica is worth queueing for; an unhealthy or
        draining one (or one already tried) is not, and the client should hear so now.
        ``last_error``: why the previous attempt failed, if this is a retry."""
        if any(view.routable and view.address not in exclude for view in views):
            return
        self.state.metrics.rejections.labels("no_healthy_replica").inc()
        poll_seconds = self.state.config.load_poll_seconds
        raise no_healthy_replica(self.model, views, exclude, last_error, poll_seconds)

    def _pick(self, key: str, exclude: set[str], decisions: list[Any]) -> str | None:
        """The admission queue's ``pick``: route now, remember the decision. A model
        removed meanwhile, or left without a replica that could take the request, fails
        the request here (the queue passes the error on) rather than stopping the queue's
        head until it times out."""
        self._check_served()
        views = self.state.fleet.views(self.model)
        if self.adapter is None:
            decision = self.state.router.route(key, views, exclude)
        else:
            load_factor = self.state.config.routing.load_factor
            decision = adapters.route_adapter(
                self.state.router, self.adapter, key, views, exclude, load_factor
            )
        if decision is None:
            self._check_routable(views, exclude)  # only busy: wait in the queue
            return None
        decisions.append(decision)
        return str(decision.address)

    # ---- what the relay reports while it hands the output over ---------------------------
    def count(self, delta: Any) -> None:
        self.output_tokens += len(delta.token_ids)

    def handed_over(self) -> None:
        """A delta with text reached the client (streaming) or the answer (whole): the
        f and e instants of docs/architecture.md's latency definitions."""
        self.e = time.monotonic()
        if self.f is None:
            self.f = self.e

    def finished(self, index: int, final: Any) -> None:
        """Sample ``index`` ended with ``final``; after the last one, the request is done."""
        self.finals[index] = final
        if len(self.finals) < len(self.grpc_calls):
            return
        self.done = True
        prompt_tokens, output_tokens, cached_tokens, _ = self.usage()
        self.usage_tokens = prompt_tokens + output_tokens
        reasons = [self.finals[i].finish_reason for i in range(len(self.finals))]
        self.span.set_attribute("gen_ai.response.finish_reasons", reasons)
        self.span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        self.span.set_attribute("gen_ai.usage.cache_read.input_tokens", cached_tokens)

    def _prompt_used(self) -> int:
        """The prompt tokens of a request that ends before its finals: each prompt's as
        its replica counted them once it has, else (an older replica, or none computed
        yet) at least the estimate."""
        prompts = len(self.grpc_calls) // self.samples
        counted = {i // self.samples: n for i, n in self.prompt_tokens.items()}
        if len(counted) == prompts:
            return sum(counted.values())
        return max(self.prompt_estimate, sum(counted.values()))

    def usage(self) -> tuple[int, int, int, int | None]:
        """Prompt, output and cached prompt tokens of the finished samples (each prompt
        once, its first sample's figures; every sample's output), and their reasoning
        tokens where their replica's reasoning parser counted them (else None)."""
        firsts = [f.usage for i, f in self.finals.items() if i % self.samples == 0]
        output_tokens = sum(f.usage.completion_tokens for f in self.finals.values())
        prompt_tokens = sum(u.prompt_tokens for u in firsts)
        counted = [f.usage for f in self.finals.values() if f.usage.HasField("reasoning_tokens")]
        reasoning = sum(u.reasoning_tokens for u in counted) if counted else None
        return prompt_tokens, output_tokens, sum(u.cached_tokens for u in firsts), reasoning

    def failed_upstream(self, exc: grpc.aio.AioRpcError) -> OpenAIError:
        """The request failed after its first output (never retried: output was sent):
        counted, and the error the client gets (a 400 where the engine refused it as
        invalid mid-generation, e.g. a grammar that fails on a later token)."""
        error = refused(exc) or client_error(exc, self.state.config.request_timeout_seconds)
        self.status = error.status
        self.state.metrics.upstream_errors.labels(self.model, exc.code().name).inc()
        return error

    async def read(self, index: int) -> Any:
        """Sample ``index``'s next message."""
        return await self.grpc_calls[index].read()

    # ---- cleanup (exactly once) ----------------------------------------------------------
    def _release_slot(self) -> None:
        if self.slot is not None:
            self.state.queue.release(self.slot)
            self.slot = None

    def close(self, exc: BaseException | None, disconnected: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.done:
            for upstream in self.grpc_calls:  # aborts the samples still running in the engine
                upstream.cancel()
        self._release_slot()
        # Settle the token reservation to what was used: the replica's usage when it
        # finished, else the prompt tokens and the tokens produced before the end.
        used = self.usage_tokens if self.done else self._prompt_used() + self.output_tokens
        self.admission.finish(used if self.grpc_calls else 0)
        m = self.state.metrics
        if disconnected:
            m.disconnects.labels(self.model).inc()
            self.status = 499
        elif isinstance(exc, OpenAIError):
            self.status = exc.status
        elif exc is not None:
            self.status = 500
        m.requests.labels(self.model, str(self.status)).inc()
        if self.status == 200:
            m.observe_timeline(self.model, self.s, self.f, self.e)
        self.span.set_attribute("http.response.status_code", self.status)
        self.span.end()


async def _first_message(upstream: Any) -> Any:
    """An upstream request's first message, or the error it failed with."""
    try:
        return await upstream.read()
    except grpc.aio.AioRpcError as exc:
        return exc
