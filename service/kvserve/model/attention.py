"""Attention over the paged KV cache for a flattened batch of mixed requests.

The batch's tokens are laid out decodes first (one token each), then prefill chunks.
Each layer writes the new keys/values into their cache slots, then gathers every
request's context through its block table and runs ``scaled_dot_product_attention``:
one call for all decodes and one for all prefill chunks (padded to the longest chunk,
with a mask that is causal from each chunk's offset in its sequence).

A layer's cache has shape [num_blocks, block_size, kv_heads, head_dim] but is stored
heads-major (a permuted view of a [kv_heads, num_blocks, block_size, head_dim] tensor):
gathered keys then reach the attention kernel with each head's keys contiguous, which
on CPU is ~3× faster than the token-major layout (no hidden copy in the kernel).
Masks are additive (0 / -inf) in the model dtype, built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DecodeGroup:
    """Consecutive decode tokens whose contexts are gathered to one padded length."""

    start: int  # first token of the group in the batch
    block_tables: torch.Tensor  # [B, max_blocks]
    mask: torch.Tensor  # additive, [B, 1, 1, max_blocks * block_size]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decodes: int  # the first `num_decodes` tokens are single-token decodes
    # Decodes sorted by context length, split where that saves padding.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_block_tables: torch.Tensor | None = None  # [Bp, max_blocks]
    prefill_mask: torch.Tensor | None = None  # additive, [Bp, 1, Qmax, max_blocks * block_size]
    prefill_dest: torch.Tensor | None = None  # [Tp] row of each prefill token in [Bp*Qmax]
    num_prefills: int = 0
    max_query_len: int = 0
    # One prefill with nothing cached before it: plain causal attention on its own keys.
    single_fresh_prefill: bool = False


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A zeroed [num_blocks, block_size, kv_heads, head_dim] cache, stored heads-major."""
    storage = torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device)
    return storage.permute(1, 2, 0, 3)


def _heads_major(cache: torch.Tensor) -> torch.Tensor:
    """The [kv_heads, num_blocks, block_size, head_dim] storage behind a cache view."""
    return cache.permute(2, 0, 1, 3)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Keys (or values) of each row's blocks: [B, kv_heads, max_blocks * block_size, d]."""
    b, nb = block_tables.shape
    _, bs, kvh, d = cache.shape
    rows = _heads_major(cache).index_select(1, block_tables.flatten())
    return rows.view(kvh, b, nb * bs, d).transpose(0, 1)


def paged_attention(
    q: torch.Tensor,  # [T, heads, d]
    k: torch.Tensor,  # [T, kv_heads, d]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Returns [T, heads * d]."""
    num_tokens, heads, d = q.shape
    kv_heads = k.shape[1]
    _heads_major(k_cache).view(kv_heads, -1, d).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    _heads_major(v_cache).view(kv_heads, -1, d).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    outputs = []
    nd = meta.num_decodes
    if nd:
        # Grouped-query trick: the query heads that share a KV head act as a short query
        # sequence against it, so no KV head is ever copied.
        group = heads // kv_heads
        for g in meta.decode_groups:
            n = g.block_tables.shape[0]
            out = F.scaled_dot_product_attention(
                q[g.start : g.start + n].view(n, kv_heads, group, d),
                _gather(k_cache, g.block_tables),
                _gather(v_cache, g.block_tables),
                attn_mask=g.mask,
                scale=scale,
            )
            outputs.append(out.reshape(n, heads * d))
    if nd < num_tokens:
        qp, kp, vp = q[nd:], k[nd:], v[nd:]
        if meta.single_fresh_prefill:
            out = F.scaled_dot_product_attention(
                qp.transpose(0, 1).unsqueeze(0),
                kp.transpose(0, 1).unsqueeze(0),
                vp.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            outputs.append(out[0].transpose(0, 1).reshape(-1, heads * d))
        else:
            assert meta.prefill_block_tables is not None and meta.prefill_dest is not None
            bp, qmax = meta.num_prefills, meta.max_query_len
            padded = qp.new_zeros(bp * qmax, heads, d).index_copy_(0, meta.prefill_dest, qp)
            out = F.scaled_dot_product_attention(
                padded.view(bp, qmax, heads, d).transpose(1, 2),
                _gather(k_cache, meta.prefill_block_tables),
                _gather(v_cache, meta.prefill_block_tables),
                attn_mask=meta.prefill_mask,
                scale=scale,
                enable_gqa=True,
            )
            rows = out.transpose(1, 2).reshape(bp * qmax, heads * d)
            outputs.append(rows.index_select(0, meta.prefill_dest))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
