"""The tiny random checkpoints the tests build (``checkpoint_dir`` in tests/conftest.py),
and prompts to run through them."""

from __future__ import annotations

import random
from typing import Any

# name → build arguments. Together they cover every supported architecture and the
# config features that change the forward pass.
CHECKPOINTS: dict[str, dict[str, object]] = {
    "llama": {"arch": "llama"},
    "llama3-tied-mqa": {
        "arch": "llama",
        "num_kv_heads": 1,
        "tie_word_embeddings": True,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"arch": "mistral", "tokenizer": "byte_fallback"},
    "qwen2": {"arch": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"arch": "qwen3", "head_dim": 32, "num_heads": 4, "num_kv_heads": 2},
}
# A chat template that renders tools in the Hermes style (the tool-calling tests build it
# themselves: it adds no architecture to compare).
TOOLS_CHECKPOINT: dict[str, object] = {
    "arch": "qwen3",
    "head_dim": 32,
    "tokenizer": "byte_level_tools",
    "max_position_embeddings": 4096,  # tool schemas and turns make long byte-level prompts
}
# Briefly trained (peaked distributions, like a real model): for dtype comparisons.
TRAINED_CHECKPOINTS: dict[str, dict[str, object]] = {
    "qwen3-trained": {"arch": "qwen3", "head_dim": 32, "train_steps": 200},
}


def make_prompts(tokenizer: Any, n: int = 24, seed: int = 0) -> list[list[int]]:
    """Prompts of many lengths, some sharing a long prefix, one repeated."""
    rng = random.Random(seed)
    words = [
        "the",
        "cache",
        "keeps",
        "keys",
        "and",
        "values",
        "for",
        "every",
        "token",
        "so",
        "a",
        "new",
        "token",
        "attends",
    ]
    shared = tokenizer.encode(" ".join(rng.choice(words) for _ in range(12)))
    prompts: list[list[int]] = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        ids = tokenizer.encode(text)
        prompts.append(shared + ids if i % 3 == 0 else ids)
    prompts.append(list(prompts[0]))  # an exact repeat
    return prompts
