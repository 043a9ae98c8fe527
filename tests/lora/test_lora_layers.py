"""The batched LoRA math (``kvserve.lora.layers``) against a per-token reference: each
token's output gains its own adapter's ``B(A(x)) * scaling`` on each part of each fused
projection, and nothing for base-model tokens, in both formulations (stacked slots and
per-adapter segments), for contiguous and interleaved token orders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM
from kvserve.lora import LoRARequest, layers
from kvserve.lora.adapter import LoRAWeights, projection_shapes
from kvserve.lora.layers import LoRALayers
from kvserve.model.config import ModelConfig
from tests.support.peft_adapters import ALL_LINEAR, ATTENTION

# Three adapters in three slots: ranks below and at the slots' rank, attention-only and
# all-linear targets, distinct scalings.
ADAPTERS = [(4, 0.5, ATTENTION), (8, 2.0, ALL_LINEAR), (8, 1.25, ALL_LINEAR)]
MAX_RANK = 8
ORDERS = {
    "contiguous": [0, 0, 1, 1, 1, -1, 2],
    "interleaved": [2, -1, 0, 1, 0, 2, 1, -1],
    "one adapter": [1, -1, 1, 1],
    "base only": [-1, -1, -1],
}
# Forcing one formulation: (STACKED_MIN_ADAPTERS, STACKED_MAX_TOKENS).
FORMULATIONS = {"stacked": (1, 10**6), "segments": (10**6, 0)}


@pytest.fixture(scope="module")
def setup(checkpoint_dir):  # type: ignore[no-untyped-def]
    ckpt: Path = checkpoint_dir("llama")
    config = ModelConfig.from_file(ckpt)
    model = LLM(str(ckpt), dtype="float32", device="cpu").engine.runner.model
    lora = LoRALayers(
        model,
        config,
        num_slots=len(ADAPTERS),
        max_rank=MAX_RANK,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    gen = torch.Generator().manual_seed(0)
    shapes = projection_shapes(config)
    adapters = []
    for slot, (rank, scaling, targets) in enumerate(ADAPTERS):
        weights = {
            (layer, name): (
                torch.randn(rank, shapes[name][0], generator=gen),
                torch.randn(shapes[name][1], rank, generator=gen),
            )
            for layer in range(config.num_layers)
            for name in targets
        }
        adapter = LoRAWeights(LoRARequest(f"a{slot}", f"/a{slot}"), rank, scaling, weights)
        lora.load(slot, adapter)
        adapters.append(adapter)
    return lora, adapters


def expected(
    adapters: list[LoRAWeights],
    layer: int,
    parts: dict[str, tuple[int, int, int]],  # name -> (index, first output column, width)
    x: torch.Tensor,
    y: torch.Tensor,
    token_slots: list[int],
) -> torch.Tensor:
    """Token by token: the base output plus the token's adapter's delta on each part."""
    out = y.clone()
    for name, (_, start, n_out) in parts.items():
        for i, slot in enumerate(token_slots):
            if slot >= 0 and (layer, name) in adapters[slot].weights:
                a, b = adapters[slot].weights[(layer, name)]
                out[i, start : start + n_out] += (b @ (a @ x[i])) * adapters[slot].scaling
    return out


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("formulation", list(FORMULATIONS))
def test_each_token_gets_its_own_adapter(
    setup, order: str, formulation: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    lora, adapters = setup
    monkeypatch.setattr(layers, "STACKED_MIN_ADAPTERS", FORMULATIONS[formulation][0])
    monkeypatch.setattr(layers, "STACKED_MAX_TOKENS", FORMULATIONS[formulation][1])
    check_every_projection(lora, adapters, ORDERS[order])


def check_every_projection(
    lora: LoRALayers, adapters: list[LoRAWeights], token_slots: list[int]
) -> None:
    lora.set_batch(token_slots)
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for (layer, name), (hook, _) in lora.projections.items():
        if hook.parts[name][0] != 0:  # one check per fused projection
            continue
        n_in = hook.a.shape[-1]
        n_out = sum(b.shape[0] for b in hook.b)
        x = torch.randn(len(token_slots), n_in, generator=gen)
        y = torch.randn(len(token_slots), n_out, generator=gen)
        want = expected(adapters, layer, hook.parts, x, y, token_slots)
        got = hook(x, y.clone())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked == 4 * len({layer for layer, _ in lora.projections})


def test_a_reused_slot_keeps_nothing_of_its_last_adapter(setup) -> None:  # type: ignore[no-untyped-def]
    lora, adapters = setup
    # Slot 1 held an all-linear rank-8 adapter; an attention-only rank-4 one replaces it:
    # its MLP parts and its rank columns beyond 4 must be zeros again.
    lora.load(1, adapters[0])
    try:
        for low, high in FORMULATIONS.values():
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(layers, "STACKED_MIN_ADAPTERS", low)
                mp.setattr(layers, "STACKED_MAX_TOKENS", high)
                check_every_projection(lora, [adapters[0], adapters[0], adapters[2]], [0, 1, 2, 1])
    finally:
        lora.load(1, adapters[1])


def test_the_step_rule_picks_stacked_slots_for_small_mixed_steps(setup) -> None:  # type: ignore[no-untyped-def]
    lora, _ = setup
    lora.set_batch([0, 1, -1])
    assert lora.batch.masks is not None  # two adapters, few tokens
    lora.set_batch([1, 1, -1])
    assert lora.batch.masks is None  # one adapter: its segment only
    lora.set_batch([0, 1] * layers.STACKED_MAX_TOKENS)
    assert lora.batch.masks is None  # a long step: segments


@pytest.mark.parametrize("formulation", list(FORMULATIONS))
def test_an_adapter_that_overflows_reaches_no_other_token(
    setup, formulation: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Finite weights so large that x·A overflows: in stacked slots every token meets
    every slot's A, and a mask's 0 times inf is NaN. The other adapters' tokens and the
    base model's must get exactly what they get without it."""
    lora, adapters = setup
    monkeypatch.setattr(layers, "STACKED_MIN_ADAPTERS", FORMULATIONS[formulation][0])
    monkeypatch.setattr(layers, "STACKED_MAX_TOKENS", FORMULATIONS[formulation][1])
    huge = LoRAWeights(
        LoRARequest("huge", "/huge"),
        adapters[1].rank,
        adapters[1].scaling,
        {key: (a * 1e38, b) for key, (a, b) in adapters[1].weights.items()},
    )
    lora.load(1, huge)
    try:
        token_slots = [0, 1, -1, 2, 1, -1]
        others = [i for i, slot in enumerate(token_slots) if slot != 1]
        lora.set_batch(token_slots)
        gen = torch.Generator().manual_seed(2)
        for (layer, name), (hook, _) in lora.projections.items():
            if hook.parts[name][0] != 0:
                continue
            x = torch.randn(len(token_slots), hook.a.shape[-1], generator=gen)
            y = torch.randn(len(token_slots), sum(b.shape[0] for b in hook.b), generator=gen)
            want = expected(adapters, layer, hook.parts, x, y, token_slots)
            got = hook(x, y.clone())
            torch.testing.assert_close(got[others], want[others], rtol=1e-4, atol=1e-4)
    finally:
        lora.load(1, adapters[1])
