"""Attention over the paged KV cache for a flattened batch of mixed requests.

The batch's tokens are laid out decodes first (one token each), then the prefill
chunks that continue a sequence, then fresh prompts. Each layer writes the new
keys/values into their cache slots, then gathers every request's context through its
block table and runs ``scaled_dot_product_attention``: one call for the decodes (two
when that saves padding) and one for the continued chunks (padded to the longest chunk,
with a mask that is causal from each chunk's offset in its sequence). A fresh prompt has
no context to gather: it is one causal call on its own keys.

A layer's cache has shape [num_blocks, block_size, kv_heads, head_dim] but is stored
heads-major (a permuted view of a [kv_heads, num_blocks, block_size, head_dim] tensor):
gathered keys then reach the attention kernel with each head's keys contiguous, which
on CPU is ~3× faster than the token-major layout (no hidden copy in the kernel).
Masks are additive (0 / -inf) in the model dtype, built once per step.

With an fp8 KV cache (``KVCache.k.dtype`` a float8 type; docs/engine.md, "fp8 KV cache")
a new key is stored as ``fp8(clamp(key / k_scale))`` and read back as ``fp8 → compute
dtype``; the scales never touch the gathered context: ``k_scale`` is folded into the
softmax scale (q·(s k̂) = s (q·k̂)) and ``v_scale`` multiplies the attention output
(Σ pᵢ s v̂ᵢ = s Σ pᵢ v̂ᵢ). PyTorch's CPU kernels do not index fp8 tensors, so writes and
gathers move the bytes as uint8 views of the same storage. On the CPU, PyTorch's own
fp8 conversions are slow, so the read path moves the bits into float16 instead
(``fp8_values``), which is vectorized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVCache(NamedTuple):
    """One layer's paged keys and values, each [num_blocks, block_size, kv_heads, d]."""

    k: torch.Tensor
    v: torch.Tensor
    # fp8 only: a stored value times its scale is the key (value) it stands for.
    k_scale: float = 1.0
    v_scale: float = 1.0


def fp8_quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` clamped to ``dtype``'s finite range (e4m3fn has no infinity: an
    out-of-range cast would be NaN) and rounded to it."""
    limit = torch.finfo(dtype).max
    return (x * (1.0 / scale)).clamp_(-limit, limit).to(dtype)


@dataclass
class DecodeGroup:
    """Consecutive decode tokens whose contexts are gathered to one padded length."""

    start: int  # first token of the group in the batch
    block_tables: torch.Tensor  # [B, max_blocks]
    rows: torch.Tensor  # its blocks' rows in the 2-D cache storage (``gather_rows``)
    mask: torch.Tensor  # additive, [B, 1, 1, max_blocks * block_size]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decodes: int  # the first `num_decodes` tokens are single-token decodes
    # Decodes sorted by context length, split where that saves padding.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_block_tables: torch.Tensor | None = None  # [Bp, max_blocks]
    prefill_rows: torch.Tensor | None = None  # their rows (``gather_rows``)
    prefill_mask: torch.Tensor | None = None  # additive, [Bp, 1, Qmax, max_blocks * block_size]
    prefill_dest: torch.Tensor | None = None  # [Tp] row of each prefill token in [Bp*Qmax]
    num_prefills: int = 0  # the prefill chunks above (after the decodes)
    max_query_len: int = 0
    # The lengths of the fresh prompts (nothing cached before them), laid out last: each
    # one is plain causal attention on its own keys, with no gather and no padding.
    fresh_lens: list[int] = field(default_factory=list)


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


def fp8_read_factor(cache: torch.Tensor) -> float:
    """What ``fp8_values`` of this cache's bytes must be multiplied by."""
    cpu_e4m3 = cache.dtype == torch.float8_e4m3fn and cache.device.type == "cpu"
    return 256.0 if cpu_e4m3 else 1.0


def fp8_values(raw: torch.Tensor, fp8: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The ``fp8`` numbers whose bytes are ``raw`` (uint8), in ``dtype``, divided by
    ``fp8_read_factor``.

    On the CPU, where PyTorch's own fp8 conversions cost several times these integer
    passes and float16's vectorized conversion (docs/engine.md, "fp8 KV cache"), the
    bits go into a float16 instead. e5m2 is float16's top byte. e4m3's sign bit stays
    the top bit and its 4 exponent and 3 mantissa bits move one bit right, into
    float16's 5 and 10: the same number times 2^-8 (float16's exponent bias is 8 more
    than e4m3's), exactly, subnormals included."""
    if raw.device.type != "cpu":
        return raw.view(fp8).to(dtype)
    if fp8 == torch.float8_e5m2:
        return raw.to(torch.int16).bitwise_left_shift_(8).view(torch.float16).to(dtype)
    bits = raw.view(torch.int8).to(torch.int16)  # sign-extended: bit 14 copies the sign
    bits.bitwise_left_shift_(7).bitwise_and_(~0x4000)  # ... so it is cleared
    return bits.view(torch.float16).to(dtype)


def gather_rows(block_tables: torch.Tensor, num_blocks: int, kv_heads: int) -> torch.Tensor:
    """For ``_gather``, once per step (every layer's cache has the same shape): the row
    of every (head, block) in a cache's storage seen as [kv_heads * num_blocks,
    block_size * d], heads first. (``index_select`` along dim 0 of a 2-D tensor copies
    whole rows, ~2× faster on the CPU than the same blocks selected along dim 1 of the
    4-D storage.)"""
    heads = torch.arange(kv_heads, device=block_tables.device)[:, None] * num_blocks
    return (heads + block_tables.flatten()[None, :]).flatten()


def _gather(
    cache: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Keys (or values) of each row's blocks, in ``dtype``: [B, kv_heads, max_blocks *
    block_size, d]; ``rows`` from ``gather_rows``. An fp8 cache is gathered as bytes,
    then converted (``fp8_values``)."""
    b, nb = block_tables.shape
    num_blocks, bs, kvh, d = cache.shape
    storage = _heads_major(cache)  # contiguous
    if cache.dtype in FP8_DTYPES:
        raw = storage.view(torch.uint8).view(kvh * num_blocks, bs * d).index_select(0, rows)
        out = fp8_values(raw, cache.dtype, dtype)
    else:
        out = storage.view(kvh * num_blocks, bs * d).index_select(0, rows)
    return out.view(kvh, b, nb * bs, d).transpose(0, 1)


def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """Write ``x`` [T, kv_heads, d] into its slots; returns what was stored (fp8 values
    for an fp8 cache, else ``x``)."""
    kv_heads, d = x.shape[1], x.shape[2]
    storage = _heads_major(cache)
    if cache.dtype in FP8_DTYPES:
        x = fp8_quantize(x, scale, cache.dtype)
        storage.view(torch.uint8).view(kv_heads, -1, d).index_copy_(
            1, slots, x.view(torch.uint8).transpose(0, 1)
        )
    else:
        storage.view(kv_heads, -1, d).index_copy_(1, slots, x.transpose(0, 1))
    return x


def paged_attention(
    q: torch.Tensor,  # [T, heads, d]
    k: torch.Tensor,  # [T, kv_heads, d]
    v: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Returns [T, heads * d]."""
    num_tokens, heads, d = q.shape
    kv_heads = k.shape[1]
    k_cache, v_cache, dtype = cache.k, cache.v, q.dtype
    fp8 = k_cache.dtype in FP8_DTYPES
    # With fp8 the new tokens attend to their keys as stored, as later steps will: the
    # output does not depend on whether a token was cached, chunked or just computed.
    k = _store(k_cache, meta.slot_mapping, k, cache.k_scale)
    v = _store(v_cache, meta.slot_mapping, v, cache.v_scale)
    if fp8:
        factor = fp8_read_factor(k_cache)
        scale *= cache.k_scale * factor

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
                _gather(k_cache, g.block_tables, g.rows, dtype),
                _gather(v_cache, g.block_tables, g.rows, dtype),
                attn_mask=g.mask,
                scale=scale,
            )
            outputs.append(out.reshape(n, heads * d))
    num_fresh = sum(meta.fresh_lens)
    if meta.num_prefills:
        assert meta.prefill_block_tables is not None and meta.prefill_dest is not None
        assert meta.prefill_rows is not None
        qp = q[nd : num_tokens - num_fresh]
        bp, qmax = meta.num_prefills, meta.max_query_len
        padded = qp.new_zeros(bp * qmax, heads, d).index_copy_(0, meta.prefill_dest, qp)
        tables, rows = meta.prefill_block_tables, meta.prefill_rows
        out = F.scaled_dot_product_attention(
            padded.view(bp, qmax, heads, d).transpose(1, 2),
            _gather(k_cache, tables, rows, dtype),
            _gather(v_cache, tables, rows, dtype),
            attn_mask=meta.prefill_mask,
            scale=scale,
            enable_gqa=True,
        )
        rows = out.transpose(1, 2).reshape(bp * qmax, heads * d)
        outputs.append(rows.index_select(0, meta.prefill_dest))
    if num_fresh:
        first = num_tokens - num_fresh
        kf, vf = k[first:], v[first:]
        if fp8:
            kf = fp8_values(kf.view(torch.uint8), k_cache.dtype, dtype)
            vf = fp8_values(vf.view(torch.uint8), v_cache.dtype, dtype)
        # Prompts of different lengths, one call each: a padded batch would compute the
        # longest prompt's square for every one of them.
        for qf, kp, vp in zip(
            q[first:].split(meta.fresh_lens),
            kf.split(meta.fresh_lens),
            vf.split(meta.fresh_lens),
            strict=True,
        ):
            out = F.scaled_dot_product_attention(
                qf.transpose(0, 1).unsqueeze(0),
                kp.transpose(0, 1).unsqueeze(0),
                vp.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            outputs.append(out[0].transpose(0, 1).reshape(-1, heads * d))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out * (cache.v_scale * factor) if fp8 else out
