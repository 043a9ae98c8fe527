"""The pool of fixed-size KV cache blocks, with reference counts and a prefix cache.

A block is *free* when no request references it. Free blocks wait in ``free_queue`` in
LRU order (the front is evicted first) and keep their hash, so a later request with the
same prefix can take them back without recomputing. Allocating a fresh block pops the
front of the queue and forgets whatever it cached.

With KV-cache events on (``kvserve.engine.kv_events``), ``events`` records what enters and
leaves the prefix cache; off, it is None and the hooks below are one check each.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.engine.kv_events import KVEventRecorder
    from kvserve.engine.request import Request


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block holds a cached full block


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.events: KVEventRecorder | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Share of blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks but only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._forget(block)  # evict its cached content
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds join the LRU tail."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take ``blocks`` out of the prefix cache (their KV was never computed: the step
        that was to compute it failed); they stay with their holders."""
        for block in blocks:
            self._forget(block)

    def _forget(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
        block.block_hash = None

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register a block that now holds a full, computed block of tokens; whether its
        hash is new to the cache."""
        if block.block_hash is not None or block_hash in self.cached:
            return False  # already cached, or an identical block is (keep the first)
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        hashes: list[bytes],
        start: int,
        end: int,
        request: Request,
    ) -> None:
        """Register ``blocks[start:end]`` of ``request``, whose hashes are ``hashes``."""
        events = self.events
        if events is None:
            for i in range(start, end):
                self.cache_block(blocks[i], hashes[i])
            return
        # Only hashes new to the cache are events: the subscriber's view stays the set
        # of hashes in ``cached``.
        new = [i for i in range(start, end) if self.cache_block(blocks[i], hashes[i])]
        if new:
            events.stored(hashes, new, request)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (and nothing done) while any block is in use,
        as vLLM does: a running request's later blocks would be cached as children of
        parents no longer cached, which KV-event subscribers cannot place."""
        if self.num_free_blocks < self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True
