"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3 checkpoints.

The differences between those families are flags in ``ModelConfig``: q/k/v bias
(Qwen2), per-head q/k RMSNorm (Qwen3), explicit ``head_dim``, Llama 3 RoPE scaling and
tied embeddings. Q/K/V and gate/up projections are fused into one matmul each; the
loader fills them from the checkpoint's separate Hugging Face tensors. With
``quantization="int8"`` the projections hold int8 weights (``quant``).

With a ``TensorGroup`` of more than one rank the model is one rank's slice
(``kvserve.parallel.shard``): its layers are built with the rank's heads and
intermediate size, o_proj and down_proj outputs are all-reduced (their biases are
loaded on rank 0 only, so they are added once), the embedding looks up the rank's
vocabulary rows and is all-reduced, and the LM head's logits are gathered on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model import cpu_gemm
from kvserve.model.attention import AttentionMetadata, KVCache, paged_attention
from kvserve.model.config import ModelConfig
from kvserve.model.quant import Int8Weight
from kvserve.model.rope import apply_rotary
from kvserve.parallel.group import TensorGroup
from kvserve.parallel.shard import local_config, vocab_rows

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel, same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # In float32, then back, as the reference implementation rounds.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(n_out, n_in, dtype=dtype)
        self.bias = _param(n_out, dtype=dtype) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN layout, see cpu_gemm
        self.int8: Int8Weight | None = None  # --quantization int8, see quant
        # (x, base output) -> output with the batch's LoRA deltas (kvserve.lora.layers).
        self.lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            y = self.int8.linear(x, self.bias)
        elif self.packed is not None:
            y = cpu_gemm.linear(x, self.packed, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)

    def prepack(self) -> None:
        """Switch to the packed weight; the plain copy is released."""
        self.packed = cpu_gemm.pack_weight(self.weight.data)
        self.weight = _param(0, dtype=self.weight.dtype)

    def quantize_int8(self, kernel: str) -> None:
        """Switch to int8 weights (``quant``); the plain copy is released."""
        self.int8 = Int8Weight.from_weight(self.weight.data, kernel)
        self.weight = _param(0, dtype=self.weight.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as stored (plain, packed or int8), bias included."""
        stored = self.int8.nbytes if self.int8 is not None else self.weight.nbytes
        packed = self.packed.nbytes if self.packed is not None else 0
        return stored + packed + (self.bias.nbytes if self.bias is not None else 0)


class Attention(nn.Module):
    """``c``: this rank's shapes; ``reduce`` sums o_proj's partial outputs over ranks."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype, reduce: Reduce = _identity) -> None:
        super().__init__()
        self.reduce = reduce
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.scale = c.head_dim**-0.5
        self.qkv_proj = Linear(c.hidden_size, c.q_size + 2 * c.kv_size, c.qkv_bias, dtype)
        self.o_proj = Linear(c.q_size, c.hidden_size, c.o_bias, dtype)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(t, heads, d))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, kv_heads, d))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:  # rotate queries and keys in one go
            qk = apply_rotary(
                qkv[:, : self.q_size + self.kv_size].view(t, heads + kv_heads, d), cos, sin
            )
            q, k = qk[:, :heads], qk[:, heads:]
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.reduce(self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, reduce: Reduce = _identity) -> None:
        super().__init__()
        self.reduce = reduce
        self.intermediate_size = c.intermediate_size
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, c.mlp_bias, dtype)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, c.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, reduce: Reduce = _identity) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Attention(c, dtype, reduce)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = MLP(c, dtype, reduce)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]


class CausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, group: TensorGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.group = group if group is not None and group.size > 1 else None
        tp = 1 if self.group is None else self.group.size
        self.local = local_config(config, tp)  # this rank's heads and intermediate size
        rows = vocab_rows(config.vocab_size, tp)
        reduce = _identity if self.group is None else self.group.all_reduce
        self.vocab = range(config.vocab_size) if group is None else group.shard.vocab(config)
        self.embed_tokens = _param(rows, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(self.local, dtype, reduce) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            None if config.tie_word_embeddings else _param(rows, config.hidden_size, dtype=dtype)
        )
        self.packed_lm_head: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self._embed(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)  # type: ignore[no-any-return]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(input_ids, self.embed_tokens)
        # Vocabulary-parallel: each rank looks up the ids in its rows, zeros the others,
        # and the all-reduce assembles every token's embedding.
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= len(self.vocab))
        x = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return self.group.all_reduce(x.masked_fill_(outside[:, None], 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the vocabulary (with tensor parallelism: on rank 0; every
        rank must call it, the other ranks get their slice)."""
        if self.packed_lm_head is not None:
            logits = cpu_gemm.linear(hidden, self.packed_lm_head, None).float()
        else:
            weight = self.embed_tokens if self.lm_head is None else self.lm_head
            logits = F.linear(hidden, weight).float()
        if self.group is None:
            return logits
        return self.group.gather_logits(logits, self.config.vocab_size)

    def quantize_int8(self, kernel: str = "auto") -> None:
        """int8 weights for every decoder projection (q/k/v, o, gate/up, down); the
        embeddings and the LM head keep the model's dtype (docs/engine.md, int8 weights)."""
        for layer in self.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    module.quantize_int8(kernel)

    def weight_nbytes(self) -> int:
        """Bytes the loaded weights take as stored (after packing or quantization)."""
        total = self.embed_tokens.nbytes
        total += self.lm_head.nbytes if self.lm_head is not None else 0
        total += self.packed_lm_head.nbytes if self.packed_lm_head is not None else 0
        for module in self.modules():
            if isinstance(module, Linear):
                total += module.nbytes
            elif isinstance(module, RMSNorm):
                total += module.weight.nbytes
        return total

    def prepack_cpu_weights(self) -> bool:
        """Use oneDNN-packed weights for every matmul when this CPU build supports it."""
        if self.embed_tokens.device.type != "cpu" or not cpu_gemm.prepacking_supported(
            self.embed_tokens.dtype
        ):
            return False
        for module in self.modules():
            if isinstance(module, Linear) and module.int8 is None:  # int8: its own kernel
                module.prepack()
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        self.packed_lm_head = cpu_gemm.pack_weight(head.data)
        if self.lm_head is not None:
            self.lm_head = _param(0, dtype=head.dtype)
        return True
