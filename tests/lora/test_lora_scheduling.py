"""The scheduler with LoRA slots, on a fake setup (no model): the slot table's invariants
hold after every step, a request for a missing adapter waits without blocking others,
and no mix of arrivals and adapters deadlocks or starves a request (hypothesis)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.lora.request import LoRARequest
from kvserve.lora.slots import SlotTable
from kvserve.outputs import RequestMetrics
from kvserve.sampling_params import SamplingParams

BLOCK = 4
ADAPTERS = [LoRARequest(f"a{i}", f"/adapters/a{i}") for i in range(5)]


class Setup:
    """A scheduler, its KV pool and slot table; ``loads`` records every slot fill."""

    def __init__(self, slots: int, blocks: int = 64, budget: int = 16, max_seqs: int = 4) -> None:
        self.loads: list[tuple[int, Hashable]] = []
        self.slots = SlotTable(slots, lambda s, k: self.loads.append((s, k)))
        self.kv = KVCacheManager(blocks, BLOCK, enable_prefix_caching=True)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            clock=lambda: 0.0,
            lora_slots=self.slots,
        )
        self._ids = itertools.count()

    def add(self, lora: LoRARequest | None, prompt_len: int = 6, max_tokens: int = 3) -> Request:
        rid = f"r{next(self._ids)}"
        req = Request(
            rid,
            [7] * prompt_len,  # equal prompts: only the adapter keeps their blocks apart
            SamplingParams(max_tokens=max_tokens),
            RequestMetrics(0.0),
            lora=lora,
        )
        self.scheduler.add_request(req)
        return req

    def step(self) -> list[Request]:
        """One step as LLMEngine does it, with a fake token; returns what ran."""
        out = self.scheduler.schedule()
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token(1)
                if req.num_output_tokens >= req.params.max_tokens:
                    self.scheduler.finish(req)
        check_invariants(self)
        return [r for r, _ in out.scheduled]


def check_invariants(s: Setup) -> None:
    table = s.slots
    resident = [k for k in table.keys if k is not None]
    assert len(resident) == len(set(resident)), "an adapter in two slots"
    for slot, key in enumerate(table.keys):
        running = [r for r in s.scheduler.running if r.lora is not None and r.lora == key]
        assert table.pins[slot] == (len(running) if key is not None else 0)
    for req in s.scheduler.running:
        assert req.lora is None or table.slot_of(req.lora) is not None


def test_missing_adapter_waits_without_blocking_others() -> None:
    s = Setup(slots=1)
    long_a0 = s.add(ADAPTERS[0], max_tokens=6)
    assert s.step() == [long_a0]
    blocked = s.add(ADAPTERS[1])  # the only slot is pinned by a0
    base = s.add(None)
    younger_a0 = s.add(ADAPTERS[0])
    ran = s.step()
    assert base in ran and blocked not in ran
    # a0's slot drains for the older request: the younger a0 request waits too.
    assert younger_a0 not in ran and s.slots.draining == 0
    while not long_a0.is_finished:
        s.step()
    while blocked.status is RequestStatus.WAITING:
        s.step()
    assert s.slots.keys == [ADAPTERS[1]]
    while not (blocked.is_finished and younger_a0.is_finished):
        s.step()
    assert base.is_finished


def test_same_prompt_under_two_adapters_shares_no_blocks() -> None:
    s = Setup(slots=2)
    first = s.add(ADAPTERS[0], prompt_len=12)
    s.step()
    other = s.add(ADAPTERS[1], prompt_len=12)
    again = s.add(ADAPTERS[0], prompt_len=12)
    s.step()
    assert other.num_cached_tokens == 0
    assert again.num_cached_tokens == 8  # two full blocks of `first`'s prompt
    assert not set(s.kv.block_ids(other.request_id)) & set(s.kv.block_ids(first.request_id))


arrivals = st.lists(
    st.tuples(
        st.integers(0, 3),  # steps before it arrives
        st.one_of(st.none(), st.sampled_from(ADAPTERS)),
        st.integers(1, 20),  # prompt tokens
        st.integers(1, 8),  # max_tokens
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(arrivals, st.integers(1, 3), st.integers(10, 40), st.integers(4, 24))
def test_random_arrivals_never_deadlock(
    plan: list[tuple[int, LoRARequest | None, int, int]], slots: int, blocks: int, budget: int
) -> None:
    s = Setup(slots=slots, blocks=blocks, budget=budget)
    added: list[Request] = []
    steps = 0
    for wait, lora, prompt_len, max_tokens in plan:
        for _ in range(wait):
            s.step()
            steps += 1
        added.append(s.add(lora, prompt_len, max_tokens))
    # Every step with work schedules something, and everything finishes in bounded time:
    # each request needs at most (prompt + output) tokens, recomputed after a preemption.
    bound = 50 * sum(r.num_prompt_tokens + r.params.max_tokens for r in added) + 100
    while s.scheduler.num_unfinished:
        assert s.step(), "a step with unfinished requests scheduled nothing (deadlock)"
        steps += 1
        assert steps < bound, "a request starved"
    assert all(r.is_finished for r in added)
    assert s.slots.pins == [0] * slots
    assert s.kv.pool.num_free_blocks == blocks
