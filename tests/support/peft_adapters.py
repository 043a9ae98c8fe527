"""Tiny PEFT LoRA adapters for the LoRA tests, made by peft itself, and the reference
outputs of Hugging Face + peft (``PeftModel``, unmerged)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from tests.support.device import TEST_DEVICE

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def build_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: list[str] | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    **config: Any,
) -> Path:
    """Save a random adapter for the checkpoint at ``base_dir`` (``lora_B`` non-zero, so
    the adapter changes the output) to ``out_dir``; returns ``out_dir``."""
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    lora_config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ATTENTION,
        use_rslora=use_rslora,
        init_lora_weights=False,  # random B too: a fresh adapter must change the output
        lora_dropout=0.0,
        **config,
    )
    peft_model = get_peft_model(model, lora_config)
    peft_model.save_pretrained(out_dir)
    return out_dir


def edit_config(adapter_dir: Path, **changes: Any) -> None:
    path = adapter_dir / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def hf_greedy(
    base_dir: Path,
    prompts: list[list[int]],
    max_tokens: int,
    adapter_dir: Path | None = None,
    **generate: Any,
) -> list[list[int]]:
    """Greedy fp32 tokens of transformers on the test device: of the base model, or under
    the adapter through ``PeftModel`` (unmerged). The reference of every equivalence test.
    ``generate``: more ``generate`` arguments (logits processors such as
    ``repetition_penalty``)."""
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.to(TEST_DEVICE).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                input_ids=torch.tensor([ids], device=TEST_DEVICE),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=TEST_DEVICE),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                **generate,
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs
