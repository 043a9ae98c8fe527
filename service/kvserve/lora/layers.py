"""The batched LoRA math: every adapter of a mixed batch applied in one forward pass.

Each of the model's four (fused) projections per layer gets a hook (``Linear.lora``)
that holds, per device slot and per sub-projection (q, k, v for ``qkv_proj``; gate, up
for ``gate_up_proj``), that part's ``A`` and ``B``, zero-padded to ``max_lora_rank``. A
rank- or target-less part adds exact zeros. The layout is part-major: ``a`` is
``[parts, slots, r, n_in]`` and part ``j``'s ``B`` for every slot is ``b[j]``,
``[n_j, slots, r]``; so one matmul against ``a`` viewed as ``[parts·slots·r, n_in]``
gives, for each part, every slot's rank columns side by side, which part ``j``'s ``B``
viewed as ``[n_j, slots·r]`` consumes in one more matmul.

Two formulations, chosen per step by measurement (docs/engine.md, "Choosing the batched
formulation"):

- **stacked slots**, for a step with at least ``STACKED_MIN_ADAPTERS`` adapters and at
  most ``STACKED_MAX_TOKENS`` tokens (decode steps): one matmul of the batch against
  every slot's ``A`` at once, an in-place multiply by a per-token mask that keeps the
  token's own slot's columns times its adapter's scaling (zero for the other slots and
  for base-model tokens), then per part one ``addmm_`` against every slot's ``B`` into
  that part's output columns: 2 + parts ops per projection whatever the number of
  adapters and the tokens' order (the engine orders decodes by context length, so an
  adapter's tokens are rarely contiguous). The mask is built once per step in
  ``set_batch``.
- **per-adapter segments**, otherwise (one adapter; long steps, where stacked slots
  would pay every slot's FLOPs on every token): for each adapter present, its rows are
  multiplied by each part's ``A`` then ``B`` (PEFT's order: ``B(A(x)) * scaling``) and
  added in place to those rows of the output: views when the adapter's tokens are one
  contiguous range, else a gather and one ``index_add_``. Base-model tokens cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.lora.adapter import LoRAWeights
from kvserve.model.config import ModelConfig
from kvserve.model.llama import CausalLM, DecoderLayer, Linear

# The per-step choice (docs/engine.md, "Choosing the batched formulation"): stacked slots
# when the step has at least this many distinct adapters ...
STACKED_MIN_ADAPTERS = 2
# ... and at most this many tokens (above it the FLOPs of the other slots dominate).
STACKED_MAX_TOKENS = 64


@dataclass
class _Batch:
    """This step's LoRA work, prepared once for every projection.

    Segments: ``groups`` holds (slot, rows, scaling) per adapter present, rows a
    ``slice`` when the slot's tokens are contiguous, else their indices. Stacked slots:
    ``masks`` maps a projection's number of parts to its ``[tokens, parts·slots·r]``
    mask, and ``groups`` is empty."""

    groups: list[tuple[int, slice | torch.Tensor, float]] = field(default_factory=list)
    masks: dict[int, torch.Tensor] | None = None


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
        self.num_parts = len(parts)
        dtype, device = layers.dtype, layers.device
        # Part-major, so that one part's columns for every slot are one contiguous range
        # of the stacked product: a[p, slot] is [r, n_in], b[p][:, slot] is [n_p, r].
        self.a = torch.zeros(len(parts), s, r, n_in, dtype=dtype, device=device)
        self.b = [torch.zeros(n, s, r, dtype=dtype, device=device) for _, n in parts]
        # Views made once (they follow the writes): each op on the step's path is one
        # dispatcher call, and at decode sizes the calls cost as much as the FLOPs.
        self.a_all = self.a.view(len(parts) * s * r, n_in)
        self.bt_all = [b.view(b.shape[0], s * r).t() for b in self.b]
        self.bt_slot = [[b[:, i].t() for i in range(s)] for b in self.b]
        self.columns = [(start, start + n) for _, (_, start, n) in self.parts.items()]
        self.active = [False] * s  # the slot's adapter targets this projection

    def clear(self, slot: int) -> None:
        self.a[:, slot].zero_()
        for b in self.b:
            b[:, slot].zero_()
        self.active[slot] = False

    def write(self, slot: int, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        j, _, _ = self.parts[name]
        rank = a.shape[0]
        self.a[j, slot, :rank].copy_(a)
        self.b[j][:, slot, :rank].copy_(b)
        self.active[slot] = True

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.layers.batch
        if batch.masks is not None:  # stacked slots: 3 + parts ops
            xa = F.linear(x, self.a_all)
            xa.mul_(batch.masks[self.num_parts])
            # Every row meets every slot's A here: where another slot's adapter overflows
            # (x·A = inf), its mask's 0 makes NaN, which B would add to this row. Zeroed,
            # an adapter's numbers reach only its own requests' rows.
            xa.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            if self.num_parts == 1:
                return y.addmm_(xa, self.bt_all[0])
            w = xa.shape[1] // self.num_parts
            for j, (lo, hi) in enumerate(self.columns):
                y[:, lo:hi].addmm_(xa[:, j * w : (j + 1) * w], self.bt_all[j])
            return y
        for slot, rows, scaling in batch.groups:
            if not self.active[slot]:
                continue
            # Contiguous rows: views, each part's B product added in place; else one
            # gather of the rows and one scatter of the whole delta.
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            ys = y[rows] if isinstance(rows, slice) else torch.zeros_like(y[: xs.shape[0]])
            for j, (lo, hi) in enumerate(self.columns):
                ys[:, lo:hi].addmm_(
                    F.linear(xs, self.a[j, slot]), self.bt_slot[j][slot], alpha=scaling
                )
            if not isinstance(rows, slice):
                y.index_add_(0, rows, ys)
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
        self._num_parts = sorted({h.num_parts for h in hooks})

    @property
    def nbytes(self) -> int:
        """Device memory the slots take (all ``num_slots``, padded to ``max_rank``)."""
        return sum(h.a.nbytes + sum(b.nbytes for b in h.b) for h in self._hooks)

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
        rows: dict[int, list[int]] = {}
        for i, s in enumerate(token_slots):
            if s >= 0:
                rows.setdefault(s, []).append(i)
        if len(rows) >= STACKED_MIN_ADAPTERS and len(token_slots) <= STACKED_MAX_TOKENS:
            self.batch = _Batch(masks=self._masks(token_slots))
            return
        groups: list[tuple[int, slice | torch.Tensor, float]] = []
        for s, where in sorted(rows.items()):
            if where[-1] - where[0] + 1 == len(where):  # contiguous
                groups.append((s, slice(where[0], where[-1] + 1), self.scaling[s]))
            else:
                t = torch.tensor(where, dtype=torch.long).to(self.device, non_blocking=True)
                groups.append((s, t, self.scaling[s]))
        self.batch = _Batch(groups=groups)

    def _masks(self, token_slots: list[int]) -> dict[int, torch.Tensor]:
        """Per number of parts P: ``[tokens, P·slots·r]`` (a part-major stacked product's
        columns), each token's own slot's columns set to its adapter's scaling, the rest
        (and a base token's whole row) zero."""
        n = self.num_slots
        scale = [[0.0] * n for _ in token_slots]
        for row, s in zip(scale, token_slots, strict=True):
            if s >= 0:
                row[s] = self.scaling[s]
        per_slot = torch.tensor(scale, dtype=self.dtype).to(self.device, non_blocking=True)
        one_part = per_slot.repeat_interleave(self.max_rank, dim=1)
        return {p: one_part.repeat(1, p) for p in self._num_parts}
