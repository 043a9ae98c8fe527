"""Byte-level BPE tokenizer and chat template of the demo travel-assistant model.

The chat format (what :data:`CHAT_TEMPLATE` renders and :func:`render_conversation` reproduces)::

    <|begin_of_text|><|system|>
    You are a helpful travel assistant. ...<|end|>
    <|user|>
    Find me a ryokan in Kyoto under $200 with an onsen.<|end|>
    <|assistant|>
    Here are 2 ryokans in Kyoto under $200 a night with an onsen:
    1. ...<|end|>

``<|end|>`` is both the end of every turn and the EOS token, so generation stops after the
assistant's turn. ``add_generation_prompt`` appends ``<|assistant|>\\n``.

:func:`train_tokenizer` trains GPT-2 style byte-level BPE (every string round-trips exactly,
CJK and accented city names included) with the special tokens at fixed ids 0-5 (see
:data:`SPECIAL_TOKENS`); :func:`save_tokenizer` writes a directory that
``transformers.AutoTokenizer.from_pretrained`` loads, byte-identical for identical tokenizers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "ASSISTANT_TOKEN",
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "MODEL_MAX_LENGTH",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "SYSTEM_TOKEN",
    "USER_TOKEN",
    "render_conversation",
    "save_tokenizer",
    "train_tokenizer",
]

BOS_TOKEN: Final = "<|begin_of_text|>"
EOS_TOKEN: Final = "<|end|>"  # also the end of every turn
SYSTEM_TOKEN: Final = "<|system|>"
USER_TOKEN: Final = "<|user|>"
ASSISTANT_TOKEN: Final = "<|assistant|>"
PAD_TOKEN: Final = "<|pad|>"
#: Special tokens; a token's id is its index here.
SPECIAL_TOKENS: Final[tuple[str, ...]] = (
    BOS_TOKEN,
    EOS_TOKEN,
    SYSTEM_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    PAD_TOKEN,
)
_ROLES: Final[frozenset[str]] = frozenset({"system", "user", "assistant"})

#: Default context length written to tokenizer_config.json (conversations are ~60-150 tokens).
MODEL_MAX_LENGTH: Final = 512

CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def render_conversation(
    messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False
) -> str:
    """The text :data:`CHAT_TEMPLATE` renders for ``messages`` (the training text format)."""
    parts = [BOS_TOKEN]
    for message in messages:
        role = message["role"]
        if role not in _ROLES:
            raise ValueError(f"unknown role {role!r}")
        parts.append(f"<|{role}|>\n{message['content']}{EOS_TOKEN}\n")
    if add_generation_prompt:
        parts.append(f"{ASSISTANT_TOKEN}\n")
    return "".join(parts)


def _special(token: str) -> AddedToken:
    return AddedToken(token, special=True, normalized=False, single_word=False, lstrip=False)


_SPECIAL_RE: Final = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def _without_special_tokens(texts: Iterable[str]) -> Iterator[str]:
    """The pieces of ``texts`` between special tokens, as ``encode`` sees them.

    The trainer does not split off added tokens itself, so without this it would learn merges
    such as ``<|`` and ``_text|>`` that encoding never uses.
    """
    for text in texts:
        for piece in _SPECIAL_RE.split(text):
            if piece:
                yield piece


def train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str], min_frequency: int
) -> Tokenizer:
    """GPT-2 style byte-level BPE: ``special_tokens`` at ids 0.., then the 256 byte symbols,
    then merges up to ``vocab_size``; deterministic for the same texts. (The test
    tokenizers in ``kvserve.testing`` are built with it too.)"""
    min_size = len(special_tokens) + 256
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[_special(t) for t in special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> Tokenizer:
    """Train byte-level BPE on ``texts`` (e.g. rendered conversations); deterministic.

    Ids 0-5 are :data:`SPECIAL_TOKENS` (never split, never merged with text), then the 256 byte
    symbols, then the merges up to ``vocab_size`` (fewer if the texts have fewer pairs).
    ``encode`` adds no BOS/EOS: the chat template writes them.
    """
    tok = train_byte_level_bpe(
        _without_special_tokens(texts), vocab_size, SPECIAL_TOKENS, min_frequency=2
    )
    for i, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != i:  # pragma: no cover - guaranteed by the trainer
            raise AssertionError(f"special token {token!r} did not get id {i}")
    return tok


def _dump_json(obj: Any, path: Path, sort_keys: bool) -> None:
    text = json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=sort_keys) + "\n"
    path.write_text(text, encoding="utf-8")


def save_tokenizer(
    tok: Tokenizer, out_dir: str | os.PathLike[str], model_max_length: int = MODEL_MAX_LENGTH
) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads the result as a
    ``PreTrainedTokenizerFast`` with the chat template, ``<|begin_of_text|>`` as BOS,
    ``<|end|>`` as EOS and ``<|pad|>`` as padding. The JSON is written with a fixed layout
    (sorted keys except in ``tokenizer.json``, whose vocabulary stays in id order), so the
    same tokenizer always gives byte-identical files. Returns the directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _dump_json(json.loads(tok.to_str()), out / "tokenizer.json", sort_keys=False)
    extra = [SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": extra,
    }
    config = {
        **special_map,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    _dump_json(config, out / "tokenizer_config.json", sort_keys=True)
    _dump_json(special_map, out / "special_tokens_map.json", sort_keys=True)
    return out
