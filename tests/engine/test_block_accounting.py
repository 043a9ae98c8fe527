"""Property-based: any sequence of add / step / abort keeps the KV pool consistent."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import LLMEngine

MAX_SEQS, BUDGET, BLOCK, BLOCKS = 4, 12, 4, 24


def check_invariants(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    held = [b for blocks in engine.kv.req_blocks.values() for b in blocks]
    refs: dict[int, int] = {}
    for b in held:
        refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0), f"block {block.block_id} refcount"
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
    for h, block in pool.cached.items():
        assert block.block_hash == h
    sched = engine.last_schedule
    if sched is not None:
        assert sched.num_batched_tokens <= BUDGET
    assert len(engine.scheduler.running) <= MAX_SEQS
    for req in engine.scheduler.running:
        assert len(engine.kv.req_blocks[req.request_id]) * BLOCK >= req.num_computed_tokens
    # The model runner's block tables mirror the manager's lists exactly.
    for rid, blocks in engine.kv.req_blocks.items():
        assert engine.kv.tables.block_ids(rid) == [b.block_id for b in blocks], rid


@pytest.fixture(scope="module")
def engine(checkpoint_dir) -> LLMEngine:  # type: ignore[no-untyped-def]
    llm = LLM(
        str(checkpoint_dir("llama")),
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=BLOCKS,
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=BUDGET,
    )
    return llm.engine


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 90), st.integers(1, 20), st.booleans()),
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    max_size=25,
)
_ids = itertools.count()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops)
def test_blocks_always_return_to_pool(engine: LLMEngine, ops) -> None:  # type: ignore[no-untyped-def]
    live: list[str] = []
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, share = op
            prompt = (shared if share else []) + [(n * 7 + i) % 500 + 3 for i in range(n)]
            rid = f"r{next(_ids)}"
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            if len(prompt) + max_tokens > BLOCKS * BLOCK:
                with pytest.raises(ValueError, match="blocks"):
                    engine.add_request(rid, prompt, params)
                continue
            engine.add_request(rid, prompt, params)
            live.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                for out in engine.step():
                    if out.finished:
                        live.remove(out.request_id)
                check_invariants(engine)
        elif live:
            rid = live.pop(op[1] % len(live))
            [out] = engine.abort_request(rid)
            assert out.finished and out.outputs[0].finish_reason == "abort"
            check_invariants(engine)
    # Drain what's left: every request finishes, and the pool is whole again.
    while engine.has_unfinished_requests():
        engine.step()
        check_invariants(engine)
    assert engine.kv.pool.num_free_blocks == BLOCKS
    assert not engine.kv.req_blocks
