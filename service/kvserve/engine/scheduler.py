"""Continuous batching: which requests run this step, and how many tokens each gets.

Each step spends a token budget (``max_num_batched_tokens``): first on running requests
that decode (one token each), then on running requests still prefilling, then on waiting
requests in arrival order. A prompt longer than what is left of the budget is prefilled
in chunks over several steps. When the KV pool runs dry, the most recently admitted
running request is preempted: its blocks are freed and it goes back to the head of the
queue, to be recomputed later (its cached blocks often survive and make that cheap).

Every request handed to the scheduler can run now: a request with structured outputs is
added only once its grammar is compiled (``LLMEngine`` holds it until then).

Speculative decoding (``proposer``) extends the one rule rather than adding another. A
request's *known* tokens are its prompt, its output and its drafts (``spec_token_ids``),
and each step still gives it tokens until ``num_computed_tokens`` catches up with them. A
decoding request with ``d`` drafts is therefore scheduled for ``1 + d`` tokens (its last
token and the drafts), within the budget, with KV slots for all of them; the step's logits
at those positions verify the drafts. Invariant, after every step: ``num_computed_tokens
== num_tokens - 1`` for a decoding request; the KV of rejected drafts is garbage past that
point, their positions are overwritten when real tokens reach them, and the blocks that
held only rejected positions are given back (``KVCacheManager.trim``). Prefix-cache
hashes only ever cover ``all_token_ids`` (committed tokens), never drafts. Drafts are
proposed only when fewer than ``speculative_max_batch`` requests decode in the step
(beyond that, verifying costs more than it saves), only for requests that
``can_speculate``, and never beyond ``max_tokens`` or ``max_model_len``. Drafts come last,
after every running request has its token or chunk and the waiting requests have been
admitted, from what is left of the budget and the pool: a request whose drafts do not fit
runs without them (or with fewer), and nobody is preempted or kept waiting for a draft.

With LoRA adapters (``lora_slots``), a waiting request also needs its adapter in one of
the device's slots. One that cannot get a slot this step is passed over, in its place in
the queue, and the requests behind it are considered: ``kvserve.lora.slots`` says why
this cannot starve it or deadlock. Only the KV pool stops the scan (first come, first
served for blocks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request, RequestStatus
from kvserve.lora.slots import SlotTable
from kvserve.spec_decode.proposer import Proposer


@dataclass
class SchedulerOutput:
    # (request, number of new tokens to compute), in the order chosen.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        clock: Callable[[], float],
        lora_slots: SlotTable | None = None,
        proposer: Proposer | None = None,
        speculative_max_batch: int = 1,
        max_model_len: int | None = None,
    ) -> None:
        self.kv = kv
        self.proposer = proposer
        self.speculative_max_batch = speculative_max_batch
        self.max_model_len = max_model_len
        self.lora_slots = lora_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}

        # Running requests: decodes first, then those still prefilling.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        speculate = self.proposer is not None and len(decodes) < self.speculative_max_batch
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                scheduled[req.request_id] = num_new
                budget -= num_new

        # Waiting requests, first come first served. After a preemption the pool is
        # short, so admit nobody new this step. A request whose adapter has no slot yet
        # is passed over (it keeps its place).
        slots = self.lora_slots
        if slots is not None:
            slots.begin_step()
        passed_over: list[Request] = []  # back at the head, in order, after the scan
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            if req.lora is not None:
                assert slots is not None, "LLMEngine refuses adapters when LoRA is off"
                if not slots.reserve(req.lora):
                    passed_over.append(self.waiting.popleft())
                    continue
            hits = self.kv.get_computed_blocks(req)
            num_hit_tokens = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(req, num_new, hits):
                break
            self.waiting.popleft()
            if req.lora is not None and slots is not None:
                slots.pin(req.lora)
            if req.num_cached_tokens < 0:  # first admission, not a resume after preemption
                req.num_cached_tokens = num_hit_tokens
                self.kv.record_prefix_lookup(req.num_prompt_tokens, num_hit_tokens)
                req.metrics.first_scheduled_time = self.clock()
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))

        # Drafts last, from what is left (see the module docstring).
        for req in decodes if speculate else ():
            if budget == 0:
                break
            if scheduled.get(req.request_id) == 1 and self._schedule_drafts(req, budget):
                scheduled[req.request_id] += len(req.spec_token_ids)
                budget -= len(req.spec_token_ids)

        by_id = {r.request_id: r for r in self.running}
        out.scheduled = [(by_id[rid], n) for rid, n in scheduled.items()]
        return out

    def _schedule_drafts(self, req: Request, budget: int) -> bool:
        """Propose at most ``budget`` drafts for a decoding request already given KV slots
        for its last token, and slots for them; False (and no drafts) when there are none
        or they do not fit in the free blocks."""
        assert self.proposer is not None
        if not req.can_speculate:
            return False
        # The drafts plus the token sampled after them stay within max_tokens and
        # max_model_len.
        limit = min(budget, req.params.max_tokens - req.num_output_tokens - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - req.num_tokens - 1)
        if limit <= 0:
            return False
        drafts = self.proposer.draft(req, limit)
        if not drafts or not self.kv.allocate_slots(req, 1 + len(drafts)):
            return False
        req.spec_token_ids = drafts
        return True

    def _preempt(self, req: Request) -> None:
        req.spec_token_ids = []
        self._leave_running(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request wherever it is and free its blocks."""
        if req.status is RequestStatus.RUNNING:
            self._leave_running(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        if self.proposer is not None:
            self.proposer.finished(req)

    def _leave_running(self, req: Request) -> None:
        self.running.remove(req)
        if req.lora is not None and self.lora_slots is not None:
            self.lora_slots.unpin(req.lora)
