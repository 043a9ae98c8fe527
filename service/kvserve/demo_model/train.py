"""Train the bundled demo model from its seed: corpus -> tokenizer -> LlamaForCausalLM.

Plain PyTorch on the CPU, with transformers' own ``LlamaForCausalLM`` as the network so the
saved checkpoint is exactly what Hugging Face tools expect. Everything random comes from
the seed: the corpus (``corpus.train_rng``), the weight init and the batch order
(``torch.Generator``). The loss covers the assistant's turns only (their text and the
``<|end|>`` that closes them): the model has to learn to answer, not to imitate users.

Reproducibility: the same seed, the same library versions and the same CPU kind give the
same bytes. Training runs on a fixed number of threads (``TrainConfig.threads``) because
OpenMP reductions split work by thread count, and floating-point sums depend on the split.

The bundled checkpoint's recipe is :data:`TOOL_RECIPE` (the default): two in five of the
conversations offer the ``search_hotels`` tool, the tokenizer gets the tool tokens and
the tool-aware template. ``--no-tools`` trains the first recipe (``TrainConfig()``),
without them. Both run on two threads: on a busy machine two OpenMP threads stall whenever
another process takes a core (measured: ~5x the wall time of one thread under load), so
train on a quiet one.
Another CPU kind (AVX-512 vs AVX2 kernels) can change the last bits of the weights; the
tokenizer and corpus are byte-identical everywhere. ``kvserve train-demo --check`` says
which files match.

``--adapter travel-table`` trains the demo LoRA adapter instead (``train_adapter``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.arg_types import output_dir
from kvserve.demo_model import corpus
from kvserve.demo_model.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    MODEL_MAX_LENGTH,
    PAD_TOKEN,
    render_conversation,
    save_tokenizer,
    train_tokenizer,
)

if TYPE_CHECKING:  # imported where it runs: eval-demo reads this module's recipes only
    import torch

#: The files that make up the checkpoint (what ``--check`` compares).
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the demo model's bytes."""

    seed: int = 0
    num_conversations: int = 60_000
    tool_share: float = 0.0  # of the conversations, those that offer the tool
    tokenizer_conversations: int = 20_000
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 2
    max_position_embeddings: int = MODEL_MAX_LENGTH
    rope_theta: float = 10_000.0
    batch_size: int = 16
    steps: int = 1500
    peak_lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 100
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    threads: int = 2


#: Tool use (issue 19): two in five conversations offer the tool, and 1,600 steps, so that
#: the answers learn to copy the result (they start to between 300 and 600 steps' worth of
#: tool conversations); ~12 minutes on two threads of the development machine (the model
#: card). The template lists tools as signatures, which keeps tool conversations short.
TOOL_RECIPE = TrainConfig(tool_share=corpus.TOOL_SHARE, steps=1600, threads=2)


@dataclass
class TrainResult:
    out_dir: Path
    num_params: int
    train_tokens: int  # loss-bearing tokens seen
    seconds: float
    final_loss: float


Progress = Callable[[str], None]


def token_id(tokenizer: Any, token: str) -> int:
    tid = tokenizer.token_to_id(token)
    if tid is None:
        raise ValueError(f"the tokenizer has no {token!r} token")
    return int(tid)


# ---- data ------------------------------------------------------------------------------
def encode_corpus(
    conversations: Sequence[corpus.Conversation], tokenizer: Any
) -> list[tuple[list[int], list[int]]]:
    """(token ids, labels) per conversation; labels are -100 outside the assistant turns.

    A turn's labels start after ``<|assistant|>\\n`` (the generation prompt) and end with its
    ``<|end|>``.
    """
    assistant = tokenizer.token_to_id(ASSISTANT_TOKEN)
    end = token_id(tokenizer, EOS_TOKEN)
    newline = tokenizer.encode("\n").ids
    encoded = tokenizer.encode_batch(
        [render_conversation(c.messages, tools=c.tools) for c in conversations]
    )
    out: list[tuple[list[int], list[int]]] = []
    for enc in encoded:
        ids: list[int] = enc.ids
        labels = [-100] * len(ids)
        i = 0
        while i < len(ids):
            if ids[i] != assistant:
                i += 1
                continue
            first = i + 1 + len(newline)
            if ids[i + 1 : first] != newline:
                raise ValueError("the chat format changed: no newline after <|assistant|>")
            last = first
            while last < len(ids) - 1 and ids[last] != end:
                last += 1
            labels[first : last + 1] = ids[first : last + 1]
            i = last + 1
        out.append((ids, labels))
    return out


def batches(
    examples: Sequence[tuple[list[int], list[int]]],
    batch_size: int,
    pad_id: int,
    generator: torch.Generator,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of padded batches, shuffled; similar lengths share a batch (less padding)."""
    import torch

    order = torch.randperm(len(examples), generator=generator).tolist()
    # sort within windows of 64 batches, then shuffle the batches
    window = batch_size * 64
    groups: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: len(examples[i][0]))
        groups += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    groups = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
    out = []
    for group in groups:
        width = max(len(examples[i][0]) for i in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        labels = torch.full((len(group), width), -100, dtype=torch.long)
        for row, i in enumerate(group):
            seq, lab = examples[i]
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, : len(lab)] = torch.tensor(lab)
        out.append((ids, labels))
    return out


# ---- model -----------------------------------------------------------------------------
def model_config(cfg: TrainConfig, tokenizer: Any) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (a LlamaConfig), written with sorted keys."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_id(tokenizer, BOS_TOKEN),
        "eos_token_id": token_id(tokenizer, EOS_TOKEN),
        "pad_token_id": token_id(tokenizer, PAD_TOKEN),
        "head_dim": cfg.hidden_size // cfg.num_heads,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "num_key_value_heads": cfg.num_kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": tokenizer.get_vocab_size(),
    }


def _lr(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr``."""
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.peak_lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def _write_json(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def train(cfg: TrainConfig, out_dir: Path, progress: Progress = print) -> TrainResult:
    """Build the whole checkpoint in ``out_dir`` from ``cfg``; returns what it measured."""
    import torch
    import transformers
    from safetensors.torch import save_file

    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        progress(f"generating {cfg.num_conversations:,} conversations (seed {cfg.seed}) ...")
        conversations = corpus.generate_corpus(cfg.num_conversations, cfg.seed, cfg.tool_share)
        progress(f"training a {cfg.vocab_size}-token byte-level BPE tokenizer ...")
        texts = [render_conversation(c.messages, tools=c.tools) for c in conversations]
        tok = train_tokenizer(
            texts[: cfg.tokenizer_conversations], cfg.vocab_size, tool_tokens=cfg.tool_share > 0
        )
        save_tokenizer(tok, out_dir)
        examples = encode_corpus(conversations, tok)
        longest = max(len(ids) for ids, _ in examples)
        if longest > cfg.max_position_embeddings:
            raise ValueError(f"a conversation has {longest} tokens > max_position_embeddings")

        config = model_config(cfg, tok)
        torch.manual_seed(cfg.seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        model.train()
        num_params = sum(p.numel() for p in model.parameters())
        progress(
            f"model: {num_params / 1e6:.2f}M parameters, {cfg.num_layers} layers, hidden "
            f"{cfg.hidden_size}, vocab {tok.get_vocab_size()}; {cfg.steps} steps of "
            f"{cfg.batch_size} conversations on {cfg.threads} threads"
        )
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        optim = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.peak_lr,
            betas=(0.9, 0.95),
            eps=1e-8,
        )
        generator = torch.Generator().manual_seed(cfg.seed)
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
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optim.step()
            seen += int((labels[:, 1:] != -100).sum())
            value = loss.detach().item()
            smooth = value if smooth is None else 0.95 * smooth + 0.05 * value
            if step % 100 == 0 or step == cfg.steps - 1:
                elapsed = time.perf_counter() - started
                progress(
                    f"step {step + 1:5d}/{cfg.steps}  loss {smooth:.3f}  lr {_lr(step, cfg):.2e}"
                    f"  {elapsed:6.0f} s"
                )

        # Tied embeddings: the checkpoint holds embed_tokens only (as HF saves it).
        state = {
            k: v.detach().contiguous()
            for k, v in model.state_dict().items()
            if k != "lm_head.weight"
        }
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        _write_json(config, out_dir / "config.json")
        _write_json(
            {
                "bos_token_id": config["bos_token_id"],
                "eos_token_id": config["eos_token_id"],
                "pad_token_id": config["pad_token_id"],
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.9,
                "max_new_tokens": 256,
            },
            out_dir / "generation_config.json",
        )
    finally:
        torch.set_num_threads(old_threads)
    seconds = time.perf_counter() - started
    progress(f"wrote {out_dir} in {seconds:.0f} s")
    return TrainResult(out_dir, num_params, seen, seconds, smooth or float("nan"))


def file_digests(directory: Path) -> dict[str, str]:
    """sha256 of each checkpoint file that exists in ``directory``."""
    return {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
        for name in CHECKPOINT_FILES
        if (directory / name).exists()
    }


# ---- CLI -------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        type=output_dir,
        help="where to write the checkpoint (default: the bundled model's directory, "
        "i.e. regenerate it in place)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="train into a temporary directory and compare every file with the bundled "
        "model's (exit 1 if any differs)",
    )
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument(
        "--steps",
        type=int,
        help=f"default: {TOOL_RECIPE.steps} ({TrainConfig.steps} with --no-tools)",
    )
    p.add_argument(
        "--no-tools",
        action="store_true",
        help="the first recipe, without tool conversations or tool tokens (the bundled "
        "model's until it learned tools; see its model card)",
    )
    p.add_argument(
        "--adapter",
        metavar="NAME",
        help="train the demo LoRA adapter NAME (travel-table) on the frozen bundled model "
        "instead (CPU, a few minutes); --out defaults to its bundled folder",
    )


def _run_adapter(args: argparse.Namespace) -> int:
    from kvserve.demo_model import ADAPTER_NAMES, ADAPTERS_DIR, default_model_dir

    if args.adapter not in ADAPTER_NAMES or args.check or args.no_tools:
        print(
            f"kvserve train-demo: error: --adapter must be one of {', '.join(ADAPTER_NAMES)}, "
            "without --check or --no-tools",
            file=sys.stderr,
        )
        return 2
    from kvserve.demo_model.train_adapter import AdapterConfig, train_adapter

    base = AdapterConfig(name=args.adapter)
    cfg = dataclasses.replace(base, seed=args.seed, steps=args.steps or base.steps)
    out = Path(args.out) if args.out else ADAPTERS_DIR / args.adapter

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    res = train_adapter(cfg, out, default_model_dir(), say)
    say(
        f"{res.num_params:,} LoRA parameters, {res.train_tokens:,} loss tokens, final loss "
        f"{res.final_loss:.3f}, {res.seconds / 60:.1f} min"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    import tempfile

    from kvserve.demo_model import DEMO_MODEL_DIR

    if args.steps is not None and args.steps < 1:
        print("kvserve train-demo: error: --steps must be ≥ 1", file=sys.stderr)
        return 2
    if args.adapter is not None:
        return _run_adapter(args)
    base = TrainConfig() if args.no_tools else TOOL_RECIPE  # the bundled model's recipe
    cfg = dataclasses.replace(base, seed=args.seed, steps=args.steps or base.steps)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if not args.check:
        out = Path(args.out) if args.out else DEMO_MODEL_DIR
        res = train(cfg, out, say)
        say(
            f"{res.num_params / 1e6:.2f}M parameters, {res.train_tokens:,} loss tokens, "
            f"final loss {res.final_loss:.3f}, {res.seconds / 60:.1f} min"
        )
        return 0
    with tempfile.TemporaryDirectory(prefix="kvserve-train-demo-") as tmp:
        res = train(cfg, Path(tmp), say)
        fresh = file_digests(Path(tmp))
    shipped = file_digests(DEMO_MODEL_DIR)
    same = True
    for name in CHECKPOINT_FILES:
        match = name in shipped and fresh.get(name) == shipped[name]
        same &= match
        print(f"{'same     ' if match else 'DIFFERENT'}  {name}")
    print(
        "the regenerated checkpoint is byte-identical to the bundled one"
        if same
        else "the regenerated checkpoint differs (see kvserve/demo_model/train.py on why "
        "weights can differ across CPU kinds; run `kvserve eval-demo --model DIR` to compare)"
    )
    return 0 if same else 1
