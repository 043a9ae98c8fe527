"""Load a Hugging Face checkpoint directory into ``CausalLM``.

Weights are read by their Hugging Face names from ``model.safetensors`` or the shards
listed in ``model.safetensors.index.json``; separate q/k/v and gate/up tensors are
copied into the model's fused projections, which ``--quantization int8`` then turns into
int8 weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.model.config import ModelConfig
from kvserve.model.llama import CausalLM, DecoderLayer

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    elif (model_dir / "model.safetensors").exists():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir} (only safetensors checkpoints are supported)"
        )
    missing = [f for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint shard(s) missing: {', '.join(map(str, missing))}")
    return files


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
) -> CausalLM:
    """``quantization="int8"``: the decoder's projections are quantized once loaded, from
    their weights in ``dtype`` (``kvserve.model.quant``)."""
    if quantization not in (None, "int8"):
        raise ValueError(f"quantization must be None or 'int8', got {quantization!r}")
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = CausalLM(config, dtype)
    model = model.to_empty(device=device)
    _fill(model, config, model_dir)
    if quantization == "int8":
        model.quantize_int8()
        if device.type == "cuda":
            # The released full-precision weights go back to the driver, so the KV pool,
            # sized from the free memory, gets them (LLMEngine._size_kv_pool).
            torch.cuda.empty_cache()
    model.prepack_cpu_weights()
    return model.eval()


def _fill(model: CausalLM, config: ModelConfig, model_dir: Path) -> None:
    """Copy the checkpoint's tensors into ``model``. A function of its own so that its
    views of the parameters are gone when it returns: quantization releases them."""
    targets = _target_slices(model, config)
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if _IGNORED.search(name):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the embedding matrix serves as the head
                if name not in targets:
                    raise ValueError(
                        f"{path.name}: unexpected weight {name!r} for {config.architecture}"
                    )
                dest = targets[name]
                tensor = f.get_tensor(name)
                if tensor.shape != dest.shape:
                    raise ValueError(
                        f"{path.name}: weight {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)} from config.json"
                    )
                dest.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(f"checkpoint in {model_dir} lacks weights: {shown}")


def _target_slices(model: CausalLM, c: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensor name → the (view of the) parameter it fills."""
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens.data,
        "model.norm.weight": model.norm.weight.data,
    }
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head.data
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w = attn.qkv_proj.weight.data
        out[p + "self_attn.q_proj.weight"] = qkv_w[:q]
        out[p + "self_attn.k_proj.weight"] = qkv_w[q : q + kv]
        out[p + "self_attn.v_proj.weight"] = qkv_w[q + kv :]
        if attn.qkv_proj.bias is not None:
            qkv_b = attn.qkv_proj.bias.data
            out[p + "self_attn.q_proj.bias"] = qkv_b[:q]
            out[p + "self_attn.k_proj.bias"] = qkv_b[q : q + kv]
            out[p + "self_attn.v_proj.bias"] = qkv_b[q + kv :]
        out[p + "self_attn.o_proj.weight"] = attn.o_proj.weight.data
        if attn.o_proj.bias is not None:
            out[p + "self_attn.o_proj.bias"] = attn.o_proj.bias.data
        if attn.q_norm is not None and attn.k_norm is not None:
            out[p + "self_attn.q_norm.weight"] = attn.q_norm.weight.data
            out[p + "self_attn.k_norm.weight"] = attn.k_norm.weight.data
        gate_up = mlp.gate_up_proj.weight.data
        out[p + "mlp.gate_proj.weight"] = gate_up[:inter]
        out[p + "mlp.up_proj.weight"] = gate_up[inter:]
        out[p + "mlp.down_proj.weight"] = mlp.down_proj.weight.data
        if mlp.gate_up_proj.bias is not None and mlp.down_proj.bias is not None:
            out[p + "mlp.gate_proj.bias"] = mlp.gate_up_proj.bias.data[:inter]
            out[p + "mlp.up_proj.bias"] = mlp.gate_up_proj.bias.data[inter:]
            out[p + "mlp.down_proj.bias"] = mlp.down_proj.bias.data
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight.data
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.data
    return out
