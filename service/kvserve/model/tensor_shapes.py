"""The tensors a checkpoint must hold for its config.json, and their shapes.

``kvserve model verify`` (no torch) and the loader (before it allocates anything) both
compare a checkpoint's safetensors headers with these, so a config.json that does not
describe its weights is refused naming the tensor, the file and the config field,
instead of after allocating a model of the config's size (``vocab_size`` 10^12 asked
for 512 TB; ``num_hidden_layers`` 10^5 took two minutes to fail).

Standard library only (``kvserve.model.pull`` imports it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig

# Checkpoint tensors the engine computes itself, and skips.
IGNORED_TENSOR = re.compile(r"rotary_emb\.inv_freq$")
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MISSING_SHOWN = 5


@dataclass(frozen=True)
class ExpectedTensor:
    shape: tuple[int, ...]
    fields: tuple[str, ...]  # the config.json field(s) each dimension comes from


@dataclass(frozen=True)
class CheckpointTensor:
    file: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ExpectedTensors:
    """What a config implies: the tensors outside the decoder layers by name, and each
    layer's by the name after ``model.layers.<i>.`` (one table, not one per layer: a
    config may claim 10^5 layers)."""

    outer: dict[str, ExpectedTensor]
    per_layer: dict[str, ExpectedTensor]
    num_layers: int
    tied_head: bool


def expected_tensors(c: ModelConfig) -> ExpectedTensors:
    vocab = (c.vocab_size, "vocab_size")
    hidden = (c.hidden_size, "hidden_size")
    q = (c.q_size, "num_attention_heads × head_dim")
    kv = (c.kv_size, "num_key_value_heads × head_dim")
    inter = (c.intermediate_size, "intermediate_size")

    def of(*dims: tuple[int, str]) -> ExpectedTensor:
        return ExpectedTensor(tuple(n for n, _ in dims), tuple(f for _, f in dims))

    outer = {"model.embed_tokens.weight": of(vocab, hidden), "model.norm.weight": of(hidden)}
    if not c.tie_word_embeddings:
        outer["lm_head.weight"] = of(vocab, hidden)
    layer = {
        "self_attn.q_proj.weight": of(q, hidden),
        "self_attn.k_proj.weight": of(kv, hidden),
        "self_attn.v_proj.weight": of(kv, hidden),
        "self_attn.o_proj.weight": of(hidden, q),
        "mlp.gate_proj.weight": of(inter, hidden),
        "mlp.up_proj.weight": of(inter, hidden),
        "mlp.down_proj.weight": of(hidden, inter),
        "input_layernorm.weight": of(hidden),
        "post_attention_layernorm.weight": of(hidden),
    }
    if c.qkv_bias:
        layer |= {f"self_attn.{p}_proj.bias": of(q if p == "q" else kv) for p in "qkv"}
    if c.o_bias:
        layer["self_attn.o_proj.bias"] = of(hidden)
    if c.qk_norm:
        head = (c.head_dim, "head_dim")
        layer |= {"self_attn.q_norm.weight": of(head), "self_attn.k_norm.weight": of(head)}
    if c.mlp_bias:
        layer |= {
            "mlp.gate_proj.bias": of(inter),
            "mlp.up_proj.bias": of(inter),
            "mlp.down_proj.bias": of(hidden),
        }
    return ExpectedTensors(outer, layer, c.num_layers, c.tie_word_embeddings)


def checkpoint_problem(config: ModelConfig, tensors: Mapping[str, CheckpointTensor]) -> str | None:
    """Why the checkpoint's ``tensors`` (name → file and shape, from the safetensors
    headers) are not the weights ``config`` describes, or None."""
    want = expected_tensors(config)
    layers_seen: dict[int, set[str]] = {}
    for name, found in tensors.items():
        if IGNORED_TENSOR.search(name) or (name == "lm_head.weight" and want.tied_head):
            continue  # tied: the embedding matrix serves as the head
        layer = _LAYER_TENSOR.fullmatch(name)
        if layer is not None:
            index, rest = int(layer[1]), layer[2]
            if index >= want.num_layers:
                return (
                    f"{found.file}: tensor {name!r} is in layer {index}, but config.json's "
                    f"num_hidden_layers is {want.num_layers}"
                )
            layers_seen.setdefault(index, set()).add(rest)
            expected = want.per_layer.get(rest)
        else:
            expected = want.outer.get(name)
        if expected is None:
            return f"{found.file}: unexpected weight {name!r} for {config.architecture}"
        if found.shape != expected.shape:
            return _shape_mismatch(name, found, expected)
    return _missing(want, tensors, layers_seen)


def _shape_mismatch(name: str, found: CheckpointTensor, expected: ExpectedTensor) -> str:
    if len(found.shape) == len(expected.shape):
        pairs = zip(found.shape, expected.shape, expected.fields, strict=True)
        fields = [f for have, need, f in pairs if have != need]
    else:
        fields = list(expected.fields)
    named = list(dict.fromkeys(fields))
    return (
        f"{found.file}: tensor {name!r} has shape {list(found.shape)}, but config.json's "
        f"{' and '.join(named)} make{'s' if len(named) == 1 else ''} it {list(expected.shape)}"
    )


def _missing(
    want: ExpectedTensors, tensors: Mapping[str, CheckpointTensor], seen: dict[int, set[str]]
) -> str | None:
    absent = [i for i in range(want.num_layers) if i not in seen]
    if absent:
        return (
            f"config.json's num_hidden_layers is {want.num_layers}, but the checkpoint has "
            f"no tensors of {len(absent)} of them (the first: layer {absent[0]})"
        )
    missing = [name for name in want.outer if name not in tensors]
    missing += [
        f"model.layers.{i}.{rest}"
        for i in sorted(seen)
        for rest in want.per_layer
        if rest not in seen[i]
    ]
    if not missing:
        return None
    more = len(missing) - _MISSING_SHOWN
    shown = ", ".join(missing[:_MISSING_SHOWN]) + (f" and {more} more" if more > 0 else "")
    return f"the checkpoint lacks weights that config.json implies: {shown}"
