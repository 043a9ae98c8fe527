"""Load a Hugging Face checkpoint directory into ``CausalLM``.

Weights are read by their Hugging Face names from ``model.safetensors`` or the shards
listed in ``model.safetensors.index.json``; separate q/k/v and gate/up tensors are
copied into the model's fused projections, which ``--quantization int8`` then turns into
int8 weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.model.config import ModelConfig
from kvserve.model.llama import CausalLM, DecoderLayer
from kvserve.model.pull import ModelPullError, check_weights
from kvserve.model.tensor_shapes import IGNORED_TENSOR
from kvserve.parallel.group import TensorGroup
from kvserve.parallel.shard import TensorShard


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    group: TensorGroup | None = None,
) -> CausalLM:
    """``quantization="int8"``: the decoder's projections are quantized once loaded, from
    their weights in ``dtype`` (``kvserve.model.quant``). ``group``: load this rank's
    slice of the model (``kvserve.parallel.shard``)."""
    if quantization not in (None, "int8"):
        raise ValueError(f"quantization must be None or 'int8', got {quantization!r}")
    model_dir = Path(model_dir)
    files = _checked_weight_files(model_dir, config)
    with torch.device("meta"):
        model = CausalLM(config, dtype, group)
    model = model.to_empty(device=device)
    _fill(model, config, files)
    if quantization == "int8":
        model.quantize_int8()
        if device.type == "cuda":
            # The released full-precision weights go back to the driver, so the KV pool,
            # sized from the free memory, gets them (LLMEngine._size_kv_pool).
            torch.cuda.empty_cache()
    model.prepack_cpu_weights()
    return model.eval()


def _checked_weight_files(model_dir: Path, config: ModelConfig) -> list[Path]:
    """The safetensors files to read, once their headers hold the tensors ``config``
    implies: checked before anything is allocated, since a config.json that does not
    describe its weights may ask for any amount of memory (``vocab_size`` 10^12)."""
    try:
        return [model_dir / name for name in check_weights(model_dir, config)]
    except ModelPullError as e:
        raise ValueError(f"{model_dir}: {e}") from None


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: ``dest`` gets ``rows`` of it along ``dim``
    (None: all of it); ``shape`` is the whole tensor's shape in the checkpoint. A target
    with ``zero`` reads nothing: ``dest`` is zeroed (a row-parallel bias off rank 0)."""

    dest: torch.Tensor
    shape: tuple[int, ...]
    dim: int = 0
    rows: range | None = None
    zero: bool = False


def _fill(model: CausalLM, config: ModelConfig, files: list[Path]) -> None:
    """Copy the checkpoint's tensors into ``model``. A function of its own so that its
    views of the parameters are gone when it returns: quantization releases them.

    With tensor parallelism only this rank's slices are read (``get_slice``), so no rank
    ever holds a whole tensor it does not keep."""
    targets = _target_slices(model, config)
    # The last rank's vocabulary rows past the real vocabulary are padding: zeros.
    for table in (model.embed_tokens, model.lm_head):
        if table is not None:
            table.data[len(model.vocab) :].zero_()
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if IGNORED_TENSOR.search(name):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the embedding matrix serves as the head
                if name not in targets:
                    raise ValueError(
                        f"{path.name}: unexpected weight {name!r} for {config.architecture}"
                    )
                t = targets[name]
                part = f.get_slice(name)
                shape = tuple(part.get_shape())
                if shape != t.shape:
                    raise ValueError(
                        f"{path.name}: weight {name!r} has shape {shape}, "
                        f"expected {t.shape} from config.json"
                    )
                if t.zero:
                    t.dest.zero_()
                elif t.rows is None:
                    t.dest.copy_(part[:])
                elif t.dim == 0:
                    t.dest.copy_(part[t.rows.start : t.rows.stop])
                else:
                    t.dest.copy_(part[:, t.rows.start : t.rows.stop])
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(f"checkpoint in {files[0].parent} lacks weights: {shown}")


def _target_slices(model: CausalLM, c: ModelConfig) -> dict[str, _Target]:
    """Hugging Face tensor name → where (which slice of) it goes in this rank's model."""
    group = model.group
    shard = TensorShard(0, 1) if group is None else group.shard
    d = c.head_dim
    q_rows = _scaled(shard.heads(c), d)
    kv_rows = _scaled(shard.kv_heads(c), d)
    inter = shard.intermediate(c)
    vocab = model.vocab

    def whole(dest: torch.Tensor) -> _Target:
        return _Target(dest, tuple(dest.shape))

    def rows(dest: torch.Tensor, full: int, part: range) -> _Target:
        return _Target(dest, (full, *dest.shape[1:]), 0, part)

    def columns(dest: torch.Tensor, full: int, part: range) -> _Target:
        return _Target(dest, (dest.shape[0], full), 1, part)

    def once(dest: torch.Tensor) -> _Target:  # added after the all-reduce: on rank 0 only
        return _Target(dest, tuple(dest.shape), zero=shard.rank != 0)

    out = {
        "model.embed_tokens.weight": rows(
            model.embed_tokens.data[: len(vocab)], c.vocab_size, vocab
        )
    }
    out["model.norm.weight"] = whole(model.norm.weight.data)
    if model.lm_head is not None:
        out["lm_head.weight"] = rows(model.lm_head.data[: len(vocab)], c.vocab_size, vocab)
    q, kv, n = len(q_rows), len(kv_rows), c.intermediate_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w = attn.qkv_proj.weight.data
        out[p + "self_attn.q_proj.weight"] = rows(qkv_w[:q], c.q_size, q_rows)
        out[p + "self_attn.k_proj.weight"] = rows(qkv_w[q : q + kv], c.kv_size, kv_rows)
        out[p + "self_attn.v_proj.weight"] = rows(qkv_w[q + kv :], c.kv_size, kv_rows)
        if attn.qkv_proj.bias is not None:
            qkv_b = attn.qkv_proj.bias.data
            out[p + "self_attn.q_proj.bias"] = rows(qkv_b[:q], c.q_size, q_rows)
            out[p + "self_attn.k_proj.bias"] = rows(qkv_b[q : q + kv], c.kv_size, kv_rows)
            out[p + "self_attn.v_proj.bias"] = rows(qkv_b[q + kv :], c.kv_size, kv_rows)
        out[p + "self_attn.o_proj.weight"] = columns(attn.o_proj.weight.data, c.q_size, q_rows)
        if attn.o_proj.bias is not None:
            out[p + "self_attn.o_proj.bias"] = once(attn.o_proj.bias.data)
        if attn.q_norm is not None and attn.k_norm is not None:
            out[p + "self_attn.q_norm.weight"] = whole(attn.q_norm.weight.data)
            out[p + "self_attn.k_norm.weight"] = whole(attn.k_norm.weight.data)
        gate_up = mlp.gate_up_proj.weight.data
        m = len(inter)
        out[p + "mlp.gate_proj.weight"] = rows(gate_up[:m], n, inter)
        out[p + "mlp.up_proj.weight"] = rows(gate_up[m:], n, inter)
        out[p + "mlp.down_proj.weight"] = columns(mlp.down_proj.weight.data, n, inter)
        if mlp.gate_up_proj.bias is not None and mlp.down_proj.bias is not None:
            out[p + "mlp.gate_proj.bias"] = rows(mlp.gate_up_proj.bias.data[:m], n, inter)
            out[p + "mlp.up_proj.bias"] = rows(mlp.gate_up_proj.bias.data[m:], n, inter)
            out[p + "mlp.down_proj.bias"] = once(mlp.down_proj.bias.data)
        out[p + "input_layernorm.weight"] = whole(layer.input_layernorm.weight.data)
        out[p + "post_attention_layernorm.weight"] = whole(
            layer.post_attention_layernorm.weight.data
        )
    return out


def _scaled(heads: range, head_dim: int) -> range:
    """The rows of ``heads``' projections: head_dim rows each."""
    return range(heads.start * head_dim, heads.stop * head_dim)
