"""Block tables per request on top of the block pool, and prefix-cache lookups.

A full block's hash chains its parent's hash, its token ids and the request's extra keys
(the ``cache_salt`` and the LoRA adapter), so two requests share a block only when
everything before it and in it is identical, they belong to the same cache namespace,
and they run the same adapter (an adapter changes every layer's keys and values).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvserve.config import blocks_for
from kvserve.engine.block_pool import BlockPool, KVCacheBlock
from kvserve.engine.block_table import BlockTable
from kvserve.engine.request import Request

_ROOT_HASH = b"kvserve-prefix-root"


def hash_block(
    parent: bytes | None, token_ids: Sequence[int], extra: str | None, lora: str | None = None
) -> bytes:
    h = hashlib.sha256(parent or _ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    # Each key is tagged and length-prefixed: no salt (a client may choose one) can
    # imitate another salt followed by an adapter.
    for tag, key in ((b"\x00salt\x00", extra), (b"\x00lora\x00", lora)):
        if key is not None:
            data = key.encode()
            h.update(tag + len(data).to_bytes(8, "little") + data)
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same block ids as tensor rows, for the model runner (changed only here).
        self.tables = BlockTable()
        self._num_registered: dict[str, int] = {}  # leading blocks already in the cache
        # Prefix-cache statistics, in tokens, counted once per admitted request.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block ids (the model runner reads ``tables``)."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _update_block_hashes(self, request: Request) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        lora = request.lora.cache_key if request.lora is not None else None
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block(parent, tokens[i * bs : (i + 1) * bs], request.cache_salt, lora)
            )
        return hashes

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest chain of cached blocks that prefixes the request's tokens.

        At least the last token is always left to compute: its logits are needed. A request
        that asks for its prompt's logprobs needs the logits of every prompt position, so
        it computes them all (its blocks are still cached for others).
        """
        if not self.enable_prefix_caching or request.prompt_logprobs is not None:
            return []
        hashes = self._update_block_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:limit]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queried_tokens += num_query_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def can_fit(self, num_tokens: int) -> bool:
        """Could a request of this many tokens ever be held by the whole pool?"""
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens, or return False.

        ``computed_blocks`` are prefix-cache hits for a request being admitted; they are
        counted as computed before the new tokens.
        """
        rid = request.request_id
        held = self.req_blocks.setdefault(rid, [])
        num_tokens = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        need = self.blocks_needed(num_tokens) - len(held) - len(computed_blocks)
        # Hits that sit free in the LRU queue leave it when touched, so they can't be reused.
        reclaimed_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimed_hits:
            if not held:
                del self.req_blocks[rid]
            return False
        self.pool.touch(computed_blocks)
        added = [*computed_blocks, *(self.pool.allocate(need) if need > 0 else ())]
        held.extend(added)
        self.tables.extend(rid, [b.block_id for b in added])
        if self.enable_prefix_caching:
            self._register_full_blocks(request, held, num_tokens)
        return True

    def _register_full_blocks(
        self, request: Request, held: list[KVCacheBlock], num_tokens: int
    ) -> None:
        rid = request.request_id
        start = self._num_registered.get(rid, 0)
        # Only committed tokens: slots given to draft tokens (speculative decoding) may
        # hold rejected tokens' KV, which no other request may ever reuse.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        if num_full <= start:
            return
        hashes = self._update_block_hashes(request)
        self.pool.cache_full_blocks(held, hashes, start, num_full, request)  # and its events
        self._num_registered[rid] = num_full

    def uncache_uncomputed(self, request: Request) -> None:
        """Take the request's blocks past its computed tokens out of the prefix cache:
        full blocks are registered when allocated, before the step computes them, so a
        step that fails leaves them cached with KV never written, for the next request
        with that prefix to reuse."""
        held = self.req_blocks.get(request.request_id)
        if not held:
            return
        first = request.num_computed_tokens // self.block_size  # the first not all computed
        self.pool.uncache(held[first:])
        rid = request.request_id
        if rid in self._num_registered:
            self._num_registered[rid] = min(self._num_registered[rid], first)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens' (those that held
        only rejected draft tokens), tail first."""
        held = self.req_blocks.get(request.request_id)
        if not held:
            return
        keep = self.blocks_needed(num_tokens)
        if len(held) > keep:
            tail = held[keep:]
            del held[keep:]
            self.tables.truncate(request.request_id, keep)
            self.pool.free(reversed(tail))

    def free(self, request: Request) -> None:
        """Release every block the request holds (tail first, so it is evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.tables.remove(request.request_id)
        self.pool.free(reversed(blocks))
