"""The Scheduler on a real KVCacheManager with a small pool, and no model.

``step`` stands in for ``LLMEngine.step`` after the forward pass: it counts the scheduled
tokens as computed, lets each request that caught up sample a token, and finishes a
request at ``max_tokens``. Everything else is the real scheduler and KV cache.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.outputs import RequestMetrics
from kvserve.sampling_params import SamplingParams

BLOCK = 4
SAMPLED_TOKEN = 1


def make_request(
    request_id: str, prompt: list[int], *, max_tokens: int = 16, cache_salt: str | None = None
) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens),
        RequestMetrics(arrival_time=0.0),
        cache_salt=cache_salt,
    )


def tokens(first: int, n: int) -> list[int]:
    """``n`` consecutive token ids: prompts built from distinct ranges share no block."""
    return list(range(first, first + n))


def make_scheduler(
    num_blocks: int,
    *,
    budget: int = 64,
    max_num_seqs: int = 8,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    ticks = itertools.count(1)  # each call to the clock is one second later
    return Scheduler(
        KVCacheManager(num_blocks, BLOCK, enable_prefix_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        clock=lambda: float(next(ticks)),
    )


def add(sched: Scheduler, *requests: Request) -> None:
    for req in requests:
        sched.add_request(req)


def step(
    sched: Scheduler,
    *,
    sample: Callable[[Request], int] = lambda req: SAMPLED_TOKEN,
    forward: Callable[[SchedulerOutput], None] = lambda out: None,
) -> SchedulerOutput:
    out = sched.schedule()
    forward(out)
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(sample(req))
            if req.num_output_tokens == req.params.max_tokens:
                sched.finish(req)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(req.request_id, n) for req, n in out.scheduled]


def ids(requests: Iterable[Request]) -> list[str]:
    return [req.request_id for req in requests]


# ---- budget ---------------------------------------------------------------------------


def test_the_budget_goes_to_decodes_then_prefill_chunks_then_the_queue() -> None:
    sched = make_scheduler(num_blocks=64, budget=10)
    add(
        sched,
        make_request("a", tokens(100, 6)),
        make_request("b", tokens(200, 6)),
        make_request("c", tokens(300, 20)),
    )
    assert plan(step(sched)) == [("a", 6), ("b", 4)]  # c waits: the budget is spent
    # a decodes, b finishes its prompt, and c is admitted with what is left.
    assert plan(step(sched)) == [("a", 1), ("b", 2), ("c", 7)]
    assert plan(step(sched)) == [("a", 1), ("b", 1), ("c", 8)]
    assert plan(step(sched)) == [("a", 1), ("b", 1), ("c", 5)]


def test_max_num_seqs_caps_the_running_requests() -> None:
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    add(
        sched, *(make_request(rid, tokens(100 * i, 4), max_tokens=2) for i, rid in enumerate("abc"))
    )
    assert plan(step(sched)) == [("a", 4), ("b", 4)]
    assert plan(step(sched)) == [("a", 1), ("b", 1)]  # c still waits, with budget to spare
    assert ids(sched.waiting) == ["c"]
    assert plan(step(sched)) == [("c", 4)]  # a and b finished at their second token


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget() -> None:
    sched = make_scheduler(num_blocks=64, budget=8)
    long, short = make_request("long", tokens(100, 23)), make_request("short", tokens(200, 5))
    add(sched, long, short)
    schedule = []
    blocks_held = []
    for _ in range(4):
        schedule.append(plan(step(sched)))
        blocks_held.append(len(sched.kv.block_ids("long")))
    assert schedule == [
        [("long", 8)],
        [("long", 8)],
        [("long", 7), ("short", 1)],  # the last chunk leaves room to admit the next prompt
        [("long", 1), ("short", 4)],  # long decodes now; short is a chunk behind it
    ]
    assert blocks_held == [2, 4, 6, 6]  # blocks only for the tokens computed so far
    assert long.num_output_tokens == 2


# ---- preemption -----------------------------------------------------------------------


def test_a_dry_pool_preempts_the_most_recently_admitted_request() -> None:
    # Four blocks: a, b and c hold one each, and each one's 5th token needs another.
    sched = make_scheduler(num_blocks=4)
    a, b, c = (make_request(rid, tokens(100 * i, 4)) for i, rid in enumerate("abc"))
    add(sched, a, b, c)
    step(sched)
    late = make_request("late", tokens(900, 4))
    add(sched, late)

    out = step(sched)
    # a takes the last free block; b finds none, so c, admitted last, is preempted.
    assert plan(out) == [("a", 1), ("b", 1)]
    assert ids(out.preempted) == ["c"]
    assert ids(sched.running) == ["a", "b"]
    assert ids(sched.waiting) == ["c", "late"]  # back at the head, ahead of later arrivals
    assert c.status is RequestStatus.WAITING
    assert c.num_computed_tokens == 0
    assert sched.kv.block_ids("c") == []
    assert c.metrics.num_preemptions == 1
    assert sched.num_preemptions == 1


class FixedDrafts:
    """A proposer that drafts ``k`` tokens (fewer if the scheduler allows fewer)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def draft(self, req: Request, limit: int) -> list[int]:
        return [SAMPLED_TOKEN] * min(self.k, limit)

    def finished(self, req: Request) -> None:
        pass


def speculating(sched: Scheduler, k: int) -> Scheduler:
    sched.proposer = FixedDrafts(k)
    sched.speculative_max_batch = 100
    return sched


def test_drafts_take_only_the_blocks_nobody_needs_for_their_next_token() -> None:
    # Four blocks: a and b hold one each; each one's 5th token needs a second, and a's
    # four drafts would need a third: they would leave b no block for its token.
    sched = speculating(make_scheduler(num_blocks=4), k=4)
    a, b = make_request("a", tokens(100, 4)), make_request("b", tokens(200, 4))
    add(sched, a, b)
    step(sched)

    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]  # a runs without its drafts
    assert out.preempted == [] and a.spec_token_ids == []
    # Three drafts fit in the second block each one took for its token: both draft.
    sched = speculating(make_scheduler(num_blocks=4), k=3)
    a, b = make_request("a", tokens(100, 4)), make_request("b", tokens(200, 4))
    add(sched, a, b)
    step(sched)
    out = step(sched)
    assert plan(out) == [("a", 4), ("b", 4)] and out.preempted == []


def test_drafts_take_only_the_budget_left_after_every_request_has_its_token() -> None:
    sched = speculating(make_scheduler(num_blocks=16, budget=4), k=8)
    a, b = make_request("a", tokens(100, 2)), make_request("b", tokens(200, 2))
    add(sched, a, b)
    step(sched)

    out = step(sched)
    assert plan(out) == [("a", 3), ("b", 1)]  # b's token first; a's drafts fill the rest


def test_a_waiting_request_is_admitted_before_drafts_take_the_budget() -> None:
    sched = speculating(make_scheduler(num_blocks=16, budget=8), k=7)
    a = make_request("a", tokens(100, 2))
    add(sched, a)
    step(sched)  # a's prompt; alone, its next step would be its token and 7 drafts
    late = make_request("late", tokens(200, 6))
    add(sched, late)

    out = sched.schedule()
    assert plan(out) == [("a", 2), ("late", 6)]  # late's prompt first; one draft fits after
    assert sched.waiting == deque()


def test_the_newest_request_preempts_itself_when_it_cannot_grow() -> None:
    # Three blocks, one each; only c's next token (its 5th) needs a second block.
    sched = make_scheduler(num_blocks=3)
    a, b = make_request("a", tokens(100, 3)), make_request("b", tokens(200, 3))
    c = make_request("c", tokens(300, 4))
    add(sched, a, b, c)
    step(sched)

    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert ids(out.preempted) == ["c"]
    assert [len(sched.kv.block_ids(rid)) for rid in "abc"] == [1, 1, 0]


def test_no_request_is_admitted_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=4, budget=8)
    decoding = make_request("decoding", [7])
    chunked = make_request("chunked", tokens(100, 15))
    add(sched, decoding, chunked)
    assert plan(step(sched)) == [("decoding", 1), ("chunked", 7)]  # 3 of the 4 blocks held

    # The next chunk (tokens 7..13) needs 2 more blocks and 1 is free: the chunk's own
    # request is the newest, so it is preempted, freeing its half-full second block.
    out = step(sched)
    assert plan(out) == [("decoding", 1)]
    assert ids(out.preempted) == ["chunked"]
    # It would fit again now (its first block is cached, and 3 blocks are free), yet it
    # waits for the next step.
    assert ids(sched.waiting) == ["chunked"]
    assert plan(step(sched)) == [("decoding", 1), ("chunked", 7)]
    assert chunked.num_computed_tokens == 4 + 7


def test_a_resumed_request_reuses_its_cached_blocks_without_recounting_them() -> None:
    sched = make_scheduler(num_blocks=5)
    # b is admitted first and finishes at its second token; a (two full blocks and one
    # token more) after it.
    b = make_request("b", tokens(200, 8), max_tokens=2)
    a = make_request("a", tokens(100, 9))
    add(sched, b, a)
    assert plan(step(sched)) == [("b", 8), ("a", 9)]  # all 5 blocks are held now
    first_blocks = sched.kv.block_ids("a")[:2]
    assert a.num_cached_tokens == 0
    assert a.metrics.first_scheduled_time == 2.0  # the clock's second tick: b had the first

    # b needs a third block: a is preempted, and its partial tail block goes to b.
    out = step(sched)
    assert ids(out.preempted) == ["a"]
    assert b.is_finished

    out = sched.schedule()
    # a's two full blocks survived in the prefix cache: only tokens 8 and 9 are computed.
    assert plan(out) == [("a", 2)]
    assert a.num_computed_tokens == 8
    assert sched.kv.block_ids("a")[:2] == first_blocks
    # The resume is not a new admission: the prompt's cached-token count, the prefix-cache
    # statistics and the first-scheduled time all stay as they were first recorded.
    assert a.num_cached_tokens == 0
    assert (sched.kv.prefix_queried_tokens, sched.kv.prefix_hit_tokens) == (17, 0)
    assert a.metrics.first_scheduled_time == 2.0
    assert a.metrics.num_preemptions == 1


# ---- freeing --------------------------------------------------------------------------


def test_finishing_returns_every_block_and_keeps_the_prefix_cached() -> None:
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    running, queued = make_request("running", tokens(100, 9)), make_request("queued", [5])
    add(sched, running, queued)
    step(sched)
    assert sched.kv.pool.num_free_blocks == 5

    sched.finish(running)
    sched.finish(queued)  # never admitted: it holds no blocks
    assert running.is_finished and queued.is_finished
    assert sched.num_unfinished == 0
    assert sched.kv.pool.num_free_blocks == 8
    assert sched.kv.req_blocks == {}

    again = make_request("again", tokens(100, 9))
    add(sched, again)
    assert plan(step(sched)) == [("again", 1)]
    assert again.num_cached_tokens == 8


# ---- prefix cache ---------------------------------------------------------------------


def test_prefix_hits_are_shared_within_one_cache_salt_only() -> None:
    sched = make_scheduler(num_blocks=32)
    prompt = tokens(100, 10)  # two full blocks, and two tokens always computed
    add(sched, make_request("first", prompt))
    step(sched)
    salts = {"same": None, "tenant-a": "a", "tenant-a-again": "a", "tenant-b": "b"}
    for rid, salt in salts.items():
        add(sched, make_request(rid, prompt, cache_salt=salt))

    out = step(sched)
    assert plan(out) == [
        ("first", 1),
        ("same", 2),
        ("tenant-a", 10),
        ("tenant-a-again", 2),  # hits the blocks tenant-a was given earlier in this step
        ("tenant-b", 10),
    ]
    cached = {req.request_id: req.num_cached_tokens for req, _ in out.scheduled}
    assert cached == {"first": 0, "same": 8, "tenant-a": 0, "tenant-a-again": 8, "tenant-b": 0}
    assert (sched.kv.prefix_queried_tokens, sched.kv.prefix_hit_tokens) == (50, 16)

    def prefix_blocks(rid: str) -> list[int]:
        return sched.kv.block_ids(rid)[:2]

    assert prefix_blocks("same") == prefix_blocks("first")
    assert prefix_blocks("tenant-a-again") == prefix_blocks("tenant-a")
    groups = [set(prefix_blocks(rid)) for rid in ("first", "tenant-a", "tenant-b")]
    assert sum(len(g) for g in groups) == len(set().union(*groups)) == 6


def test_without_prefix_caching_identical_prompts_share_nothing() -> None:
    sched = make_scheduler(num_blocks=32, enable_prefix_caching=False)
    add(sched, make_request("first", tokens(100, 10)))
    step(sched)
    add(sched, make_request("same", tokens(100, 10)))
    assert plan(step(sched)) == [("first", 1), ("same", 10)]
    assert sched.kv.prefix_hit_tokens == 0


# ---- any workload ---------------------------------------------------------------------

# Small enough that preemption, chunking and prefix hits all happen often.
PROPERTY_BLOCKS, PROPERTY_BUDGET, PROPERTY_SEQS = 10, 8, 4
SHARED_PREFIX = tokens(50, 9)
# Far more than any generated workload needs (30 requests of at most 41 tokens).
MAX_DRAIN_STEPS = 5000


class FakeKVCache:
    """What the forward pass would find in each cache slot.

    A slot's K/V depend on the request's whole context up to that position, so the fake
    stores that context, with the request's cache salt. A request that finds anything
    else in a slot it attends to would read stale keys and values, or another tenant's.
    """

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.slots: dict[int, tuple[str | None, tuple[int, ...]]] = {}

    @staticmethod
    def content(req: Request, position: int) -> tuple[str | None, tuple[int, ...]]:
        return req.cache_salt, tuple(req.all_token_ids[: position + 1])

    @staticmethod
    def slot(table: list[int], position: int) -> int:
        return table[position // BLOCK] * BLOCK + position % BLOCK

    def forward(self, out: SchedulerOutput) -> None:
        """Write the batch's new tokens, then check every context the batch attends to.

        Like the model, all of the step's writes land before any attention reads them.
        """
        tables = {
            req.request_id: self.sched.kv.block_ids(req.request_id) for req, _ in out.scheduled
        }
        for req, n in out.scheduled:
            assert n > 0, f"{req.request_id} is scheduled without a token to compute"
            table = tables[req.request_id]
            assert len(set(table)) == len(table)
            assert len(table) * BLOCK >= req.num_computed_tokens + n
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                self.slots[self.slot(table, pos)] = self.content(req, pos)
        for req, n in out.scheduled:
            table = tables[req.request_id]
            for pos in range(req.num_computed_tokens + n):
                assert self.slots.get(self.slot(table, pos)) == self.content(req, pos), (
                    f"{req.request_id} reads a stale or foreign slot at position {pos}"
                )


def check_pool(sched: Scheduler, out: SchedulerOutput) -> None:
    pool = sched.kv.pool
    holders: dict[int, int] = {}
    for blocks in sched.kv.req_blocks.values():
        for block in blocks:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0)
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
    assert set(sched.kv.req_blocks) == {req.request_id for req in sched.running}
    assert out.num_batched_tokens <= PROPERTY_BUDGET
    assert len(sched.running) <= PROPERTY_SEQS


@dataclass
class Arrive:
    shared_prefix: bool
    own_tokens: int
    cache_salt: str | None
    max_tokens: int

    def request(self, request_id: str, first_token: int) -> Request:
        own = tokens(first_token, self.own_tokens)
        prompt = SHARED_PREFIX + own if self.shared_prefix else own
        return make_request(
            request_id, prompt, max_tokens=self.max_tokens, cache_salt=self.cache_salt
        )


@dataclass
class Steps:
    count: int


@dataclass
class Abort:
    pick: int  # which unfinished request, modulo their number


arrival = st.builds(
    Arrive,
    shared_prefix=st.booleans(),
    own_tokens=st.integers(1, 20),
    cache_salt=st.sampled_from([None, "a"]),
    max_tokens=st.integers(1, 12),
)
operations = st.lists(
    # Arrivals twice as often as the rest, so the pool runs short.
    st.one_of(
        arrival, arrival, st.builds(Steps, st.integers(1, 4)), st.builds(Abort, st.integers(0, 20))
    ),
    min_size=4,
    max_size=30,
)


def sample_from_context(req: Request) -> int:
    # Few values, and equal contexts continue alike: generated tokens share prefixes too.
    return sum(req.all_token_ids) % 3


@settings(max_examples=150, deadline=None)
@given(operations=operations)
def test_any_workload_reads_only_its_own_kv_and_keeps_the_pool_consistent(
    operations: list[Arrive | Steps | Abort],
) -> None:
    sched = make_scheduler(PROPERTY_BLOCKS, budget=PROPERTY_BUDGET, max_num_seqs=PROPERTY_SEQS)
    cache = FakeKVCache(sched)
    admitted: dict[str, Request] = {}

    def run_one_step() -> None:
        out = step(sched, sample=sample_from_context, forward=cache.forward)
        assert not out.is_empty, "requests are waiting but the step does nothing"
        admitted.update((req.request_id, req) for req, _ in out.scheduled)
        check_pool(sched, out)

    for i, op in enumerate(operations):
        match op:
            case Arrive():
                req = op.request(f"r{i}", first_token=100 * i)
                # LLMEngine refuses a request the whole pool could never hold.
                if sched.kv.can_fit(req.num_prompt_tokens + req.params.max_tokens):
                    add(sched, req)
            case Steps():
                for _ in range(op.count):
                    if sched.num_unfinished:
                        run_one_step()
            case Abort():
                unfinished = sched.running + list(sched.waiting)
                if unfinished:
                    sched.finish(unfinished[op.pick % len(unfinished)])
    for _ in range(MAX_DRAIN_STEPS):
        if not sched.num_unfinished:
            break
        run_one_step()
    assert sched.num_unfinished == 0, "requests still unfinished: the scheduler livelocks"
    assert sched.kv.pool.num_free_blocks == PROPERTY_BLOCKS
    # Each admitted prompt was looked up once, however often its request was preempted.
    assert sched.kv.prefix_queried_tokens == sum(r.num_prompt_tokens for r in admitted.values())
    assert sched.kv.prefix_hit_tokens == sum(r.num_cached_tokens for r in admitted.values())
