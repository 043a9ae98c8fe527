"""Tiny random Hugging Face checkpoints, built offline, for tests, demos and benchmarks.

The weights come from transformers' own model classes (seeded), are saved with
safetensors in the standard layout, and ship with one of the offline test tokenizers,
so ``kvserve`` and ``transformers`` load exactly the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvserve.testing.tokenizers import (
    BYTE_LEVEL_MISTRAL_TOOLS_CHAT_TEMPLATE,
    BYTE_LEVEL_TOOLS_CHAT_TEMPLATE,
    MISTRAL_TOOL_MARKER,
    TRAINING_CORPUS,
    build_byte_fallback_tokenizer,
    build_byte_level_tokenizer,
)

# ``tokenizer=`` names: the byte-level BPE (with a plain chat template, or with one that
# renders tools in the Hermes style, or in the Mistral style with a special [TOOL_CALLS]
# token), or the byte-fallback BPE.
TOKENIZERS = ("byte_level", "byte_level_tools", "byte_level_mistral_tools", "byte_fallback")

ARCHITECTURES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}


def build_random_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    tokenizer: str = "byte_level",
    initializer_range: float = 0.1,
    seed: int = 0,
    max_shard_size: str | None = None,
    train_steps: int = 0,
    **extra: Any,
) -> Path:
    """Write a random ``arch`` checkpoint to ``path``; returns the path.

    ``extra`` goes to the transformers config (e.g. ``rope_scaling``, ``attention_bias``).
    A wide ``initializer_range`` keeps greedy argmax decisions far from ties.
    ``train_steps > 0`` first fits the model briefly to the tokenizer's small corpus, so
    its next-token distributions are peaked like a trained model's (random weights give
    flat ones, where bf16 rounding flips near-ties).
    """
    import transformers

    path = Path(path)
    if tokenizer == "byte_level":
        tok = build_byte_level_tokenizer()
    elif tokenizer == "byte_level_tools":
        tok = build_byte_level_tokenizer(chat_template=BYTE_LEVEL_TOOLS_CHAT_TEMPLATE)
    elif tokenizer == "byte_level_mistral_tools":
        tok = build_byte_level_tokenizer(
            chat_template=BYTE_LEVEL_MISTRAL_TOOLS_CHAT_TEMPLATE,
            extra_special=(MISTRAL_TOOL_MARKER,),
        )
    elif tokenizer == "byte_fallback":
        tok = build_byte_fallback_tokenizer()
    else:
        raise ValueError(f"unknown tokenizer {tokenizer!r} (one of {', '.join(TOKENIZERS)})")
    config_cls = getattr(transformers, ARCHITECTURES[arch])
    kwargs: dict[str, Any] = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size or len(tok),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(extra)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if train_steps:
        _fit_to_corpus(model, tok(TRAINING_CORPUS)["input_ids"], train_steps, seed)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    tok.save_pretrained(path)
    return path


def _fit_to_corpus(model: Any, ids: list[int], steps: int, seed: int, window: int = 64) -> None:
    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(data) - window - 1, (8,), generator=gen)
        batch = torch.stack([data[s : s + window] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
