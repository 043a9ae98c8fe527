"""KVCacheManager on a real, small BlockPool: block tables, prefix hits, freeing.

No model runs here. ``compute`` plays the scheduler and the engine: it allocates slots for
the next tokens and then counts them as computed.
"""

from __future__ import annotations

from kvserve.engine.kv_cache_manager import KVCacheManager, hash_block
from kvserve.engine.request import Request
from kvserve.outputs import RequestMetrics
from kvserve.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(),
        RequestMetrics(arrival_time=0.0),
        cache_salt=cache_salt,
    )


def tokens(first: int, n: int) -> list[int]:
    """``n`` consecutive token ids: prompts built from distinct ranges share no block."""
    return list(range(first, first + n))


def compute(kv: KVCacheManager, req: Request) -> None:
    """Admit ``req`` with whatever the prefix cache holds and compute the rest of it."""
    hits = kv.get_computed_blocks(req)
    num_hit_tokens = len(hits) * BLOCK
    assert kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits)
    req.num_computed_tokens = req.num_tokens


def test_a_hit_always_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    compute(kv, make_request("first", tokens(100, 8)))
    # Its logits are needed, so a prompt made exactly of cached blocks hits all but one.
    assert len(kv.get_computed_blocks(make_request("same", tokens(100, 8)))) == 1
    assert len(kv.get_computed_blocks(make_request("longer", tokens(100, 9)))) == 2


def test_a_block_is_shared_only_when_everything_before_it_is_too() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    first, second = tokens(100, 9), tokens(200, 9)
    compute(kv, make_request("first", first))
    compute(kv, make_request("second", second))
    # Block 1 has the content of second's block 1, but its K/V were computed after
    # another block 0: the chained hash must miss it.
    mixed = first[:4] + second[4:]
    hits = kv.get_computed_blocks(make_request("mixed", mixed))
    assert [b.block_id for b in hits] == kv.block_ids("first")[:1]


def test_only_full_blocks_are_cached_and_more_as_the_request_grows() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    req = make_request("r", tokens(100, 6))
    compute(kv, req)
    assert len(kv.pool.cached) == 1  # tokens 4..5 fill half a block
    req.append_output_token(7)
    req.append_output_token(8)
    assert kv.allocate_slots(req, 2)
    assert len(kv.pool.cached) == 2
    assert kv.block_ids("r") == [b.block_id for b in kv.pool.cached.values()]


def test_without_prefix_caching_nothing_is_cached_or_hit() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    compute(kv, make_request("first", tokens(100, 9)))
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_request("same", tokens(100, 9))) == []


def test_a_cache_salt_separates_identical_prompts() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    prompt = tokens(100, 9)
    compute(kv, make_request("unsalted", prompt))
    compute(kv, make_request("tenant-a", prompt, cache_salt="a"))
    unsalted_blocks = kv.block_ids("unsalted")[:2]
    tenant_a_blocks = kv.block_ids("tenant-a")[:2]
    assert set(unsalted_blocks).isdisjoint(tenant_a_blocks)

    def hit_ids(salt: str | None) -> list[int]:
        return [b.block_id for b in kv.get_computed_blocks(make_request("q", prompt, salt))]

    assert hit_ids(None) == unsalted_blocks
    assert hit_ids("a") == tenant_a_blocks
    assert hit_ids("b") == []
    assert hash_block(None, prompt[:4], None) != hash_block(None, prompt[:4], "a")


def test_a_refused_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK, enable_prefix_caching=True)
    compute(kv, make_request("holder", tokens(100, 8)))
    assert not kv.allocate_slots(make_request("big", tokens(200, 8)), 8)
    assert "big" not in kv.req_blocks
    assert kv.pool.num_free_blocks == 1


def test_hits_waiting_in_the_free_queue_count_against_the_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK, enable_prefix_caching=True)
    first = make_request("first", tokens(100, 9))
    compute(kv, first)
    kv.free(first)  # 3 free blocks, 2 of them still caching the first 8 tokens
    too_long = make_request("too-long", tokens(100, 16))
    hits = kv.get_computed_blocks(too_long)
    assert len(hits) == 2
    # 16 tokens need 4 blocks; the 2 hits leave 2 to allocate, but taking the hits out
    # of the free queue leaves only 1 free block.
    assert not kv.allocate_slots(too_long, 8, hits)
    assert all(b.ref_cnt == 0 and b.block_id in kv.pool.free_queue for b in hits)
    assert kv.pool.num_free_blocks == 3

    # 12 tokens need 3 blocks: the 2 hits plus the one block that is free besides them.
    fits = make_request("fits", tokens(100, 12))
    assert kv.allocate_slots(fits, 4, kv.get_computed_blocks(fits))
    assert kv.block_ids("fits")[:2] == [b.block_id for b in hits]
    assert kv.pool.num_free_blocks == 0


def test_shared_blocks_stay_held_until_their_last_holder_frees_them() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    first, second = make_request("first", tokens(100, 9)), make_request("second", tokens(100, 9))
    compute(kv, first)
    compute(kv, second)
    shared = kv.req_blocks["first"][:2]
    assert kv.req_blocks["second"][:2] == shared
    assert [b.ref_cnt for b in shared] == [2, 2]
    assert kv.pool.num_free_blocks == 8 - 4  # two shared blocks and one tail each

    kv.free(first)
    assert [b.ref_cnt for b in shared] == [1, 1]
    assert kv.pool.num_free_blocks == 8 - 3
    kv.free(second)
    assert kv.pool.num_free_blocks == 8
    assert kv.req_blocks == {}


def test_a_freed_request_gives_up_its_tail_block_first() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK, enable_prefix_caching=True)
    first = make_request("first", tokens(100, 9))
    compute(kv, first)
    kv.free(first)
    # The next allocation evicts the half-full tail block, not the cached prefix, ...
    compute(kv, make_request("other", tokens(200, 3)))
    # ... so a request with the same prefix still finds both of its full blocks.
    assert len(kv.get_computed_blocks(make_request("again", tokens(100, 9)))) == 2
