"""Which slice of a model each tensor-parallel rank holds (Megatron-style).

Pure arithmetic on ``ModelConfig``, no torch: the engine's loader, the capacity
calculator and the operator's status all use these rules.

- Attention: rank r holds query heads ``[r·h/tp, (r+1)·h/tp)`` (column-parallel q) and
  the KV heads those queries read. With ``tp ≤ kv_heads`` that is ``kv_heads/tp`` of
  them; with ``tp > kv_heads`` each rank holds the one KV head of its query group, so a
  KV head is replicated on ``tp/kv_heads`` ranks. o_proj is row-parallel (its input
  columns follow the query heads), followed by an all-reduce.
- MLP: gate/up column-parallel and down row-parallel over ``intermediate/tp``.
- Vocabulary: embedding and LM head rows split in ``ceil(vocab/tp)`` pieces (the last
  one padded); embeddings are all-reduced, logits gathered on rank 0.
- Norms and biases of row-parallel layers are replicated (a bias is added once, after
  the all-reduce).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvserve.model.config import ModelConfig


def check_shardable(config: ModelConfig, tp: int) -> None:
    """ValueError, with the numbers, if ``config`` cannot be split over ``tp`` ranks."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be ≥ 1, got {tp}")
    h, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    problems = []
    if h % tp:
        problems.append(f"num_attention_heads={h} is not divisible by {tp}")
    if tp <= kv and kv % tp:
        problems.append(f"num_key_value_heads={kv} is not divisible by {tp}")
    if tp > kv and tp % kv:
        problems.append(
            f"{tp} ranks cannot share num_key_value_heads={kv} evenly (replicating KV heads "
            f"needs tensor_parallel_size to be a multiple of {kv})"
        )
    if inter % tp:
        problems.append(f"intermediate_size={inter} is not divisible by {tp}")
    if problems:
        raise ValueError(
            f"cannot shard {config.architecture} over tensor_parallel_size={tp}: "
            + "; ".join(problems)
        )


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The per-rank shapes: heads, KV heads and intermediate size of one rank (the
    vocabulary stays whole here: ``vocab_rows`` gives a rank's share)."""
    check_shardable(config, tp)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp,
        num_kv_heads=max(1, config.num_kv_heads // tp),
        intermediate_size=config.intermediate_size // tp,
    )


def vocab_rows(vocab_size: int, tp: int) -> int:
    """Embedding / LM-head rows each rank allocates: ceil(vocab / tp)."""
    return -(-vocab_size // tp)


def rank_num_params(config: ModelConfig, tp: int) -> int:
    """Parameters one rank holds (its slices plus the replicated norms and biases)."""
    local = local_config(config, tp)
    tables = 1 if config.tie_word_embeddings else 2
    whole_vocab = config.vocab_size * config.hidden_size * tables
    shard_vocab = vocab_rows(config.vocab_size, tp) * config.hidden_size * tables
    # local.num_params() already counts norms and row-parallel biases whole (they are
    # sized by hidden_size, which is not split).
    return local.num_params() - whole_vocab + shard_vocab


@dataclass(frozen=True)
class TensorShard:
    """One rank's place in a tensor-parallel group of ``size`` ranks."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")

    def heads(self, c: ModelConfig) -> range:
        """The query heads this rank computes."""
        n = c.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, c: ModelConfig) -> range:
        """The KV heads this rank stores (one, replicated, when tp > kv_heads)."""
        if self.size <= c.num_kv_heads:
            n = c.num_kv_heads // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        first = self.rank // (self.size // c.num_kv_heads)
        return range(first, first + 1)

    def intermediate(self, c: ModelConfig) -> range:
        n = c.intermediate_size // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def vocab(self, c: ModelConfig) -> range:
        """The token ids whose embedding / LM-head rows this rank holds (the last rank's
        range may be shorter than ``vocab_rows``; the rest of its rows are padding)."""
        n = vocab_rows(c.vocab_size, self.size)
        return range(min(self.rank * n, c.vocab_size), min((self.rank + 1) * n, c.vocab_size))
