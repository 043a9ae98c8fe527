"""Train the demo LoRA adapter (``kvserve train-demo --adapter travel-table``) on the CPU.

The base model (the bundled ``kvserve-travel-tiny``) stays frozen; plain PyTorch adds
LoRA ``A``/``B`` pairs to its projections (``B(A(x)) * lora_alpha / r`` added to each
projection's output, ``B`` starting at zero, as PEFT does) and trains only those on
conversations from the corpus whose assistant turns are rewritten in the adapter's style
(``table_style``). The result is written in PEFT's format, so kvserve
(``kvserve.lora.adapter``) and ``peft.PeftModel`` both load it: ``adapter_config.json``
and ``adapter_model.safetensors`` with PEFT's tensor names.

Randomness: the conversations come from their own stream (:func:`adapter_train_rng`),
neither the base model's training stream nor the evaluation prompts'; the ``A``
initialisation and the batch order from ``torch.Generator``s seeded with the same seed.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from kvserve.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME, corpus
from kvserve.demo_model.table_style import table_answer_from_base

_ATTENTION: Final = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP: Final = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterConfig:
    """Everything that determines the adapter's bytes (with the base model's)."""

    name: str = "travel-table"
    seed: int = 0
    num_conversations: int = 6_000
    rank: int = 8
    alpha: int = 16
    targets: tuple[str, ...] = _ATTENTION + _MLP
    batch_size: int = 16
    steps: int = 300
    peak_lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    grad_clip: float = 1.0
    # One thread: on a shared machine two OpenMP threads stall whenever another process
    # takes a core (see train.py).
    threads: int = 1


@dataclass
class AdapterResult:
    out_dir: Path
    num_params: int
    train_tokens: int
    seconds: float
    final_loss: float


def adapter_train_rng(seed: int) -> random.Random:
    """The random stream of the adapter's training conversations for ``seed``."""
    return random.Random(f"kvserve-demo-adapter-train:{seed}")


def styled_conversation(conv: corpus.Conversation) -> corpus.Conversation:
    """``conv`` with every assistant answer rewritten in the table style."""
    out = corpus.Conversation(tools=conv.tools, requests=list(conv.requests))
    answers = iter(conv.requests)
    for message in conv.messages:
        if message["role"] == "assistant":
            text = table_answer_from_base(next(answers), message["content"])
            message = {**message, "content": text}
        out.messages.append(message)
    return out


def adapter_corpus(n: int, seed: int) -> list[corpus.Conversation]:
    """``n`` corpus conversations (no tools) in the table style, from :func:`adapter_train_rng`."""
    rng = adapter_train_rng(seed)
    return [styled_conversation(corpus.generate_conversation(rng)) for _ in range(n)]


class LoRALinear(torch.nn.Module):
    """A frozen ``nn.Linear`` plus ``B(A(x)) * scaling`` (PEFT's unmerged LoRA forward)."""

    def __init__(
        self, base: torch.nn.Linear, rank: int, scaling: float, generator: torch.Generator
    ) -> None:
        super().__init__()
        self.base = base
        self.scaling = scaling
        self.lora_A = torch.nn.Parameter(torch.empty(rank, base.in_features))
        # PEFT's default init: A like nn.Linear's weight (kaiming uniform, a=sqrt(5)), B zero.
        bound = 1 / math.sqrt(base.in_features)
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound, generator=generator)
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling
        return out


def peft_key(layer: int, target: str, half: str) -> str:
    """PEFT's tensor name for ``lora_A``/``lora_B`` of ``target`` in ``layer``."""
    block = "self_attn" if target in _ATTENTION else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{half}.weight"


def peft_config(cfg: AdapterConfig) -> dict[str, Any]:
    """``adapter_config.json``: PEFT's LoraConfig keys, for a plain LoRA adapter."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": DEMO_MODEL_NAME,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": cfg.alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": cfg.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": list(cfg.targets),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def _lr(step: int, cfg: AdapterConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr``."""
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.peak_lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def train_adapter(
    cfg: AdapterConfig,
    out_dir: Path,
    base_dir: Path = DEMO_MODEL_DIR,
    progress: Callable[[str], None] = print,
) -> AdapterResult:
    """Train the adapter on the frozen model in ``base_dir``; write it to ``out_dir``."""
    import transformers
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from kvserve.demo_model.tokenizer import PAD_TOKEN
    from kvserve.demo_model.train import batches, encode_corpus, token_id

    started = time.perf_counter()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        progress(f"generating {cfg.num_conversations:,} table-style conversations ...")
        conversations = adapter_corpus(cfg.num_conversations, cfg.seed)
        tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
        examples = encode_corpus(conversations, tok)
        model = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model.requires_grad_(False)
        model.train()  # no dropout in this model; train() only for autograd bookkeeping
        generator = torch.Generator().manual_seed(cfg.seed)
        scaling = cfg.alpha / cfg.rank
        wrapped: dict[tuple[int, str], LoRALinear] = {}
        for i, layer in enumerate(model.model.layers):
            for target in cfg.targets:
                parent = layer.self_attn if target in _ATTENTION else layer.mlp
                lora = LoRALinear(getattr(parent, target), cfg.rank, scaling, generator)
                setattr(parent, target, lora)
                wrapped[i, target] = lora
        params = [p for m in wrapped.values() for p in (m.lora_A, m.lora_B)]
        num_params = sum(p.numel() for p in params)
        progress(
            f"LoRA r={cfg.rank} alpha={cfg.alpha} on {', '.join(cfg.targets)}: "
            f"{num_params:,} trainable parameters; {cfg.steps} steps of {cfg.batch_size} "
            f"conversations on {cfg.threads} thread(s)"
        )
        optim = torch.optim.AdamW(params, lr=cfg.peak_lr, betas=(0.9, 0.95), weight_decay=0.0)
        pad = token_id(tok, PAD_TOKEN)
        epoch: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen = 0
        smooth: float | None = None
        for step in range(cfg.steps):
            if not epoch:
                epoch = batches(examples, cfg.batch_size, pad, generator)
                epoch.reverse()  # pop() from the end keeps the shuffled order
            ids, labels = epoch.pop()
            for group in optim.param_groups:
                group["lr"] = _lr(step, cfg)
            loss = model(input_ids=ids, labels=labels).loss
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optim.step()
            seen += int((labels[:, 1:] != -100).sum())
            value = loss.detach().item()
            smooth = value if smooth is None else 0.9 * smooth + 0.1 * value
            if step % 20 == 0 or step == cfg.steps - 1:
                progress(
                    f"step {step + 1:4d}/{cfg.steps}  loss {smooth:.3f}  "
                    f"{time.perf_counter() - started:5.0f} s"
                )
        tensors: dict[str, torch.Tensor] = {}
        for (i, target), lora in sorted(wrapped.items()):
            tensors[peft_key(i, target, "A")] = lora.lora_A.detach().contiguous()
            tensors[peft_key(i, target, "B")] = lora.lora_B.detach().contiguous()
        out_dir.mkdir(parents=True, exist_ok=True)
        weights = out_dir / "adapter_model.safetensors"
        save_file(tensors, str(weights), metadata={"format": "pt"})
        # safetensors writes the file owner-only (0600); the bundled copy must be readable
        # by the unprivileged user that the container images run kvserve as.
        weights.chmod(0o644)
        (out_dir / "adapter_config.json").write_text(
            json.dumps(peft_config(cfg), indent=2, sort_keys=True) + "\n"
        )
    finally:
        torch.set_num_threads(old_threads)
    seconds = time.perf_counter() - started
    progress(f"wrote {out_dir} in {seconds:.0f} s")
    return AdapterResult(out_dir, num_params, seen, seconds, smooth or float("nan"))
