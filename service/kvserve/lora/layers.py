"""The batched LoRA math: every adapter of a mixed batch applied in one forward pass.

Each of the model's four (fused) projections per layer gets a hook (``Linear.lora``)
that holds, per device slot, the stacked ``A`` of its sub-projections (q, k, v for
``qkv_proj``; gate, up for ``gate_up_proj``) and a block-diagonal ``B`` that maps each
sub-projection's rank columns to its output columns, both zero-padded to
``max_lora_rank``. A rank- or target-less part adds exact zeros.

Formulation, chosen by measurement (``python -m kvserve.lora.measure``, docs/engine.md):
**per-adapter segments**. Once per step the batch's tokens are grouped by slot (the
engine orders the batch by slot, so each group is a contiguous range of rows); in each
projection, for each adapter present, its rows are multiplied by its ``A`` then its ``B``
(PEFT's order: ``B(A(x)) * scaling``) and added in place to those rows of the output:
two ops on views, no gather or scatter. Base-model tokens cost nothing, and only
adapters in the batch are computed (the stacked-slots and gathered-``bmm`` alternatives pay for
every slot, or for a copy of each token's weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.lora.adapter import LoRAWeights
from kvserve.model.config import ModelConfig
from kvserve.model.llama import CausalLM, DecoderLayer, Linear


@dataclass
class _Batch:
    """This step's tokens grouped by slot: (slot, rows), where rows is a ``slice`` when
    the slot's tokens are contiguous (the engine orders its batch by slot, so they are),
    else their indices."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


class _ProjectionLoRA:
    """The slots' weights for one fused projection, and its forward hook."""

    def __init__(
        self,
        parts: list[tuple[str, int]],  # (HF name, output features) in the fused order
        n_in: int,
        layers: LoRALayers,
    ) -> None:
        self.layers = layers
        s, r = layers.num_slots, layers.max_rank
        self.parts = {
            name: (j, sum(n for _, n in parts[:j]), n) for j, (name, n) in enumerate(parts)
        }
        n_out = sum(n for _, n in parts)
        dtype, device = layers.dtype, layers.device
        self.a = torch.zeros(s, len(parts) * r, n_in, dtype=dtype, device=device)
        self.b = torch.zeros(s, n_out, len(parts) * r, dtype=dtype, device=device)
        self.active = [False] * s  # the slot's adapter targets this projection

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.active[slot] = False

    def write(self, slot: int, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        j, start, n = self.parts[name]
        r, rank = self.layers.max_rank, a.shape[0]
        self.a[slot, j * r : j * r + rank].copy_(a)
        self.b[slot, start : start + n, j * r : j * r + rank].copy_(b)
        self.active[slot] = True

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scaling = self.layers.scaling
        for slot, rows in self.layers.batch.groups:
            if not self.active[slot]:
                continue
            a, b = self.a[slot], self.b[slot]
            if isinstance(rows, slice):  # views: two ops, B's product added in place
                y[rows].addmm_(F.linear(x[rows], a), b.t(), alpha=scaling[slot])
            else:
                delta = F.linear(F.linear(x.index_select(0, rows), a), b) * scaling[slot]
                y.index_add_(0, rows, delta)
        return y


class LoRALayers:
    """Installs the hooks on a model and fills its ``num_slots`` slots."""

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        *,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = dtype, device
        self.batch = _Batch()
        self.scaling = [0.0] * num_slots
        self.projections: dict[tuple[int, str], tuple[_ProjectionLoRA, str]] = {}
        c = config
        hooks: list[_ProjectionLoRA] = []
        for i, layer in enumerate(model.layers):
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            fused: list[tuple[Linear, list[tuple[str, int]], int]] = [
                (
                    attn.qkv_proj,
                    [("q_proj", c.q_size), ("k_proj", c.kv_size), ("v_proj", c.kv_size)],
                    c.hidden_size,
                ),
                (attn.o_proj, [("o_proj", c.hidden_size)], c.q_size),
                (
                    mlp.gate_up_proj,
                    [("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)],
                    c.hidden_size,
                ),
                (mlp.down_proj, [("down_proj", c.hidden_size)], c.intermediate_size),
            ]
            for linear, parts, n_in in fused:
                hook = _ProjectionLoRA(parts, n_in, self)
                linear.lora = hook
                hooks.append(hook)
                for name, _ in parts:
                    self.projections[(i, name)] = (hook, name)
        self._hooks = hooks

    @property
    def nbytes(self) -> int:
        """Device memory the slots take (all ``num_slots``, padded to ``max_rank``)."""
        return sum(h.a.nbytes + h.b.nbytes for h in self._hooks)

    def load(self, slot: int, adapter: LoRAWeights) -> None:
        """Put ``adapter`` into ``slot`` (whatever was there is overwritten)."""
        for hook in self._hooks:
            hook.clear(slot)
        for key, (a, b) in adapter.weights.items():
            hook, name = self.projections[key]
            hook.write(slot, name, a, b)
        self.scaling[slot] = adapter.scaling

    def set_batch(self, token_slots: list[int]) -> None:
        """This step's slot of each token of the flattened batch (-1: the base model)."""
        groups: list[tuple[int, slice | torch.Tensor]] = []
        rows: dict[int, list[int]] = {}
        for i, s in enumerate(token_slots):
            if s >= 0:
                rows.setdefault(s, []).append(i)
        for s, where in sorted(rows.items()):
            if where[-1] - where[0] + 1 == len(where):  # contiguous
                groups.append((s, slice(where[0], where[-1] + 1)))
            else:
                t = torch.tensor(where, dtype=torch.long).to(self.device, non_blocking=True)
                groups.append((s, t))
        self.batch.groups = groups
