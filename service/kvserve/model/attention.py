"""Attention over the paged KV cache for a flattened batch of mixed requests.

The batch's tokens are laid out decodes first (one token each), then prefill chunks.
Each layer writes the new keys/values into their cache slots, then gathers every
request's context through its block table and runs ``scaled_dot_product_attention``:
one call for all decodes and one for all prefill chunks (padded to the longest chunk,
with a mask that is causal from each chunk's offset in its sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decodes: int  # the first `num_decodes` tokens are single-token decodes
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks]
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, max_blocks * block_size]
    prefill_block_tables: torch.Tensor | None = None  # [Bp, max_blocks]
    prefill_mask: torch.Tensor | None = None  # [Bp, 1, Qmax, max_blocks * block_size]
    prefill_dest: torch.Tensor | None = None  # [Tp] row of each prefill token in [Bp*Qmax]
    num_prefills: int = 0
    max_query_len: int = 0
    # One prefill with nothing cached before it: plain causal attention on its own keys.
    single_fresh_prefill: bool = False


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, kv_heads, d] through [B, max_blocks] → [B, kv_heads, max_blocks*bs, d]."""
    b, nb = block_tables.shape
    _, bs, kvh, d = cache.shape
    return cache[block_tables].view(b, nb * bs, kvh, d).transpose(1, 2)


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
    k_cache.view(-1, kv_heads, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, d).index_copy_(0, meta.slot_mapping, v)

    outputs = []
    nd = meta.num_decodes
    if nd:
        assert meta.decode_block_tables is not None
        # Grouped-query trick: the query heads that share a KV head act as a short query
        # sequence against it, so no KV head is ever copied.
        group = heads // kv_heads
        qd = q[:nd].view(nd, kv_heads, group, d)
        out = F.scaled_dot_product_attention(
            qd,
            _gather(k_cache, meta.decode_block_tables),
            _gather(v_cache, meta.decode_block_tables),
            attn_mask=meta.decode_mask,
            scale=scale,
        )
        outputs.append(out.reshape(nd, heads * d))
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
