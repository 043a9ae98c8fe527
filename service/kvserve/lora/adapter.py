"""Read a PEFT LoRA adapter directory and check that the engine can serve it.

An adapter is ``adapter_config.json`` plus ``adapter_model.safetensors`` (never a pickle:
a server must not unpickle files). Served: LoRA on any of the q/k/v/o/gate/up/down
projections, rank ``r`` up to ``max_lora_rank``, ``lora_alpha`` scaling (``alpha / r``, or
``alpha / sqrt(r)`` with ``use_rslora``). Everything else is refused at load, with a
message that names it: DoRA, bias training, embedding or lm_head adapters (and any
``modules_to_save``), per-module ranks or alphas, a rank over the limit, a target or a
layer the model does not have, and tensors whose shapes belong to another model.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvserve.json_input import JSONInputError, read_json_object
from kvserve.lora.request import LoRARequest, unavailable_message
from kvserve.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, by their Hugging Face names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)


class LoRAError(ValueError):
    """The adapter cannot be served; the message names the reason."""


class AdapterUnreadableError(LoRAError):
    """An adapter the engine has served cannot be read back from its folder (removed,
    unreadable, or its files changed since it was loaded): the server's files, not the
    request, are at fault. The message names the adapter but not its path, which only
    the server's log shows (docs/security.md)."""

    def __init__(self, lora: LoRARequest, message: str | None = None) -> None:
        super().__init__(message or unavailable_message(lora.lora_name))
        self.lora = lora


@dataclass
class LoRAWeights:
    """One adapter's tensors, in host memory: per (layer, projection name), ``A`` [r, in]
    and ``B`` [out, r]. ``scaling`` multiplies ``B(A(x))``, in that order, as PEFT does."""

    lora: LoRARequest
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    stamp: tuple[object, ...] = ()  # ``files_stamp`` of its folder when it was read

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    @property
    def targets(self) -> list[str]:
        return sorted({name for _, name in self.weights}, key=TARGETS.index)


def projection_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """Projection name → (in features, out features) for this model."""
    return {
        "q_proj": (c.hidden_size, c.q_size),
        "k_proj": (c.hidden_size, c.kv_size),
        "v_proj": (c.hidden_size, c.kv_size),
        "o_proj": (c.q_size, c.hidden_size),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
    }


def read_config(path: Path, max_rank: int) -> tuple[int, float]:
    """Check ``adapter_config.json``; returns (rank, scaling)."""
    where = path / CONFIG_FILE
    if not where.is_file():
        raise LoRAError(f"{path} is not a PEFT adapter: it has no {CONFIG_FILE}")
    try:
        cfg = read_json_object(where)
    except JSONInputError as exc:
        raise LoRAError(f"{where}: {exc}") from None
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"peft_type {peft_type!r} is not served (only LORA adapters)")
    if cfg.get("use_dora"):
        raise LoRAError("DoRA adapters (use_dora: true) are not served")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise LoRAError(
            f"adapters that train biases (bias: {cfg.get('bias')!r}, lora_bias: "
            f"{cfg.get('lora_bias')!r}) are not served"
        )
    if cfg.get("modules_to_save"):
        raise LoRAError(
            f"modules_to_save {cfg['modules_to_save']!r} (fully trained modules, e.g. an "
            "embedding or lm_head) are not served"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAError(f"per-module ranks or alphas ({key}) are not served")
    if cfg.get("fan_in_fan_out"):
        raise LoRAError("fan_in_fan_out adapters (Conv1D layers) are not served")
    if cfg.get("target_parameters"):
        raise LoRAError("target_parameters (LoRA on raw parameters) are not served")
    if cfg.get("trainable_token_indices"):
        raise LoRAError("trainable_token_indices (embedding updates) are not served")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for name in targets:
            _check_target(str(name))
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoRAError(f"rank r={r} is over max_lora_rank={max_rank}")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"lora_alpha must be a finite number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scaling)


def _check_target(name: str) -> None:
    short = name.rsplit(".", 1)[-1]
    if short in ("embed_tokens", "lm_head"):
        raise LoRAError(f"embedding or lm_head adapters are not served (target {name!r})")
    if short not in TARGETS:
        raise LoRAError(
            f"target {name!r} is not a projection of this model (targets may be "
            f"{', '.join(TARGETS)})"
        )


def files_stamp(path: Path) -> tuple[object, ...]:
    """What tells an adapter folder's files apart from others at the same path: each
    file's inode, size and modification time (a folder swapped in by rename, as
    ``kvserve adapters sync`` does, or a file rewritten in place, gets another)."""
    stamp: list[object] = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = os.stat(path / name)
        except OSError:
            stamp.append(None)
        else:
            stamp.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamp)


def load_adapter(lora: LoRARequest, model: ModelConfig, max_rank: int) -> LoRAWeights:
    """Read and check the adapter at ``lora.lora_path`` (float32 tensors, host memory)."""
    path = Path(lora.lora_path)
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter {lora.lora_name!r}: {path} is not a directory")
    stamp = files_stamp(path)  # before reading: a change while reading shows later
    rank, scaling = read_config(path, max_rank)
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        pickle = (path / "adapter_model.bin").exists()
        raise LoRAError(
            f"{path} has no {WEIGHTS_FILE}"
            + (" (adapter_model.bin is a pickle, which is never loaded)" if pickle else "")
        )
    shapes = projection_shapes(model)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                m = _KEY.match(key)
                if m is None:
                    raise LoRAError(f"{WEIGHTS_FILE}: {_why_refused(key)}")
                layer, name, half = int(m[1]), m[2], m[3]
                if layer >= model.num_layers:
                    raise LoRAError(
                        f"{WEIGHTS_FILE}: {key!r} is for layer {layer}; the model has "
                        f"{model.num_layers} layers"
                    )
                halves.setdefault((layer, name), {})[half] = f.get_tensor(key)
    except (SafetensorError, OSError) as exc:  # empty, truncated, garbled, unreadable
        raise LoRAError(f"{weights_file} is not a readable safetensors file: {exc}") from None
    if not halves:
        raise LoRAError(f"{weights_file} holds no LoRA weights")
    out = LoRAWeights(lora, rank, scaling, stamp=stamp)
    for (layer, name), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"layer {layer} {name}: lora_A and lora_B must both be present")
        a, b = pair["A"].float(), pair["B"].float()
        n_in, n_out = shapes[name]
        if a.shape != (rank, n_in) or b.shape != (n_out, rank):
            raise LoRAError(
                f"layer {layer} {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"do not fit this model's projection ({n_in} -> {n_out}, r={rank}): the "
                "adapter was made for another model"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"layer {layer} {name}: lora_A or lora_B holds NaN or infinity")
        out.weights[(layer, name)] = (a.contiguous(), b.contiguous())
    return out


def _why_refused(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return f"{key!r} is a DoRA magnitude: DoRA adapters are not served"
    if "embed_tokens" in key or "lm_head" in key or "lora_embedding" in key:
        return f"{key!r}: embedding or lm_head adapters are not served"
    if key.endswith(".bias"):
        return f"{key!r}: adapters that train biases are not served"
    m = re.search(r"\.([A-Za-z_0-9]+)\.lora_[AB]\.weight$", key)
    if m is not None:
        return f"{key!r}: target {m[1]!r} is not a projection of this model"
    return f"{key!r} is not a LoRA weight of a q/k/v/o/gate/up/down projection"
