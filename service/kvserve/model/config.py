"""The subset of a Hugging Face ``config.json`` the engine needs, validated.

One parser serves the model loader and the capacity calculator, so a config the
engine refuses is also refused by ``kvserve calc`` (never sized wrongly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.config import blocks_for
from kvserve.json_input import JSONInputError, read_json_object

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or feature the engine cannot run."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        given_dir = path.is_dir()
        if given_dir:
            path = path / "config.json"
        try:
            data = read_json_object(path)
        except JSONInputError as e:
            if e.missing:
                where = f"no config.json in {path.parent}" if given_dir else f"{path}: no such file"
                raise FileNotFoundError(where) from None
            raise ValueError(f"{path}: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
        if not archs and cfg.get("model_type") is None:
            raise UnsupportedModelError(
                "the config names no architecture (neither 'architectures' nor 'model_type')"
            )
        if arch not in SUPPORTED_ARCHITECTURES:
            named = f"architecture {arch!r}" if archs else f"model_type {cfg['model_type']!r}"
            raise UnsupportedModelError(
                f"{named} is not supported; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        _refuse_unsupported_features(cfg, arch)

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ValueError(f"config.json lacks required field {key!r}")
            return cfg[key]

        def size(key: str, value: Any) -> int:
            """A dimension or count: a whole number ≥ 1 (JSON may spell it 64.0)."""
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"config.json: {key} must be a number, got {value!r}")
            if not (math.isfinite(value) and value == int(value) and value >= 1):
                raise ValueError(f"config.json: {key} must be a whole number ≥ 1, got {value!r}")
            return int(value)

        hidden = size("hidden_size", need("hidden_size"))
        heads = size("num_attention_heads", need("num_attention_heads"))
        kv_heads = size("num_key_value_heads", cfg.get("num_key_value_heads") or heads)
        head_dim = size("head_dim", cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only 'silu')")

        rope_theta, rope_scaling = _parse_rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=size("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size", need("intermediate_size")),
            num_layers=size("num_hidden_layers", need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=size(
                "max_position_embeddings", cfg.get("max_position_embeddings", 2048)
            ),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama/Mistral/Qwen3 follow attention_bias.
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    # ---- sizes (formulas fixed in docs/architecture.md §3) -------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count; tied embeddings are counted once."""
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h  # two RMSNorms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * per_layer + h  # final norm

    def projection_params(self) -> tuple[int, int]:
        """Weights and output rows of all layers' attention and MLP projections (q/k/v,
        o, gate/up, down; biases not included): what ``quantization="int8"`` stores as
        int8, one scale per row."""
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        weights = h * (q + 2 * kv) + q * h + 3 * h * i
        rows = (q + 2 * kv) + h + 2 * i + h
        return self.num_layers * weights, self.num_layers * rows

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element


def total_blocks(token_counts: list[int], block_size: int) -> int:
    """KV blocks needed for requests of the given lengths: Σ ceil(Tᵢ / block_size)."""
    return sum(blocks_for(t, block_size) for t in token_counts)


def _arch_from_model_type(model_type: Any) -> str | None:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }.get(str(model_type))


def _refuse_unsupported_features(cfg: dict[str, Any], arch: str) -> None:
    if cfg.get("kv_lora_rank") or cfg.get("q_lora_rank"):
        raise UnsupportedModelError("multi-head latent attention (MLA) is not supported")
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"):
        if cfg.get(key):
            raise UnsupportedModelError(f"mixture-of-experts models ({key}) are not supported")
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        kinds = sorted(set(layer_types) - {"full_attention"})
        raise UnsupportedModelError(
            f"hybrid attention layers ({', '.join(kinds)}) are not supported"
        )
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
    if window is not None and uses_window:
        raise UnsupportedModelError(
            f"sliding-window attention (sliding_window={window}) is not supported"
        )


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers ≥ 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )
