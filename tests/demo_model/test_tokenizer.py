"""Tests for the demo model's tokenizer training, saving and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvserve.demo_model.corpus import Conversation, generate_corpus
from kvserve.demo_model.tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    render_conversation,
    save_tokenizer,
    train_tokenizer,
)

VOCAB = 600  # small, to keep training fast
FILES = ("special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")
UNICODE_TEXTS = [
    "京都 Kyōto 東京 서울 Reykjavík Wien Lisboa",
    "Kyoto, onsen, under $200 — what do you have? 🙂 ñ ü ß 👩‍👩‍👧",
    "  two leading spaces, trailing space ",
    "tabs\tand\nnewlines\n\n<|user|>inline special<|end|>",
]


@pytest.fixture(scope="module")
def conversations() -> list[Conversation]:
    return generate_corpus(2000, seed=0)


@pytest.fixture(scope="module")
def texts(conversations: list[Conversation]) -> list[str]:
    return [render_conversation(c.messages) for c in conversations]


@pytest.fixture(scope="module")
def tok(texts: list[str]) -> Tokenizer:
    return train_tokenizer(texts, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def hf(tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    path = save_tokenizer(tok, tmp_path_factory.mktemp("demo_tok"))
    loaded = AutoTokenizer.from_pretrained(path)
    assert isinstance(loaded, PreTrainedTokenizerFast)
    return loaded


def test_special_token_ids(tok: Tokenizer, hf: PreTrainedTokenizerFast) -> None:
    assert SPECIAL_TOKENS == (
        "<|begin_of_text|>",
        "<|end|>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|pad|>",
    )
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i
        assert hf.convert_tokens_to_ids(token) == i
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 5)
    assert tok.get_vocab_size() == VOCAB == len(hf)
    # No merges were learned from pieces of the special tokens.
    specials = set(SPECIAL_TOKENS)
    assert not [t for t in tok.get_vocab() if t not in specials and ("<|" in t or "|>" in t)]


def test_rendered_conversation_encodes_special_tokens_whole(
    conversations: list[Conversation], hf: PreTrainedTokenizerFast
) -> None:
    conv = next(c for c in conversations if c.messages[0]["role"] == "system")
    ids = hf(render_conversation(conv.messages))["input_ids"]
    assert ids[:2] == [0, 2]  # bos, <|system|>: encode adds no bos of its own
    assert ids.count(1) == len(conv.messages)  # one <|end|> per message
    assert ids.count(4) == len(conv.requests)


def test_round_trip(texts: list[str], tok: Tokenizer, hf: PreTrainedTokenizerFast) -> None:
    for text in texts[:300] + UNICODE_TEXTS:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
        assert hf.decode(hf(text)["input_ids"]) == text


def test_chat_template_matches_render_conversation(
    conversations: list[Conversation], hf: PreTrainedTokenizerFast
) -> None:
    assert hf.chat_template == CHAT_TEMPLATE
    picks = [
        next(c for c in conversations if c.messages[0]["role"] == "system"),
        next(c for c in conversations if c.messages[0]["role"] != "system"),
        next(c for c in conversations if len(c.requests) == 2),
        *conversations[:5],
    ]
    unicode_conv = [{"role": "user", "content": t} for t in UNICODE_TEXTS]
    for messages in [c.messages for c in picks] + [unicode_conv]:
        for prompt_only in (False, True):
            msgs = messages[:-1] if prompt_only else messages  # ends with a user turn
            for gen in (False, True):
                rendered = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                assert rendered == render_conversation(msgs, add_generation_prompt=gen)
    assert render_conversation([{"role": "user", "content": "hi"}], True) == (
        "<|begin_of_text|><|user|>\nhi<|end|>\n<|assistant|>\n"
    )


def test_render_conversation_rejects_unknown_roles() -> None:
    with pytest.raises(ValueError):
        render_conversation([{"role": "tool", "content": "x"}])


def test_training_and_saving_are_deterministic(texts: list[str], tmp_path: Path) -> None:
    first = save_tokenizer(train_tokenizer(texts[:500], vocab_size=400), tmp_path / "a")
    second = save_tokenizer(train_tokenizer(texts[:500], vocab_size=400), tmp_path / "b")
    assert sorted(p.name for p in first.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_vocab_size_bounds(texts: list[str]) -> None:
    with pytest.raises(ValueError):
        train_tokenizer(texts[:10], vocab_size=100)
    # A tiny corpus runs out of merges: the vocabulary is then smaller than asked for.
    small = train_tokenizer(texts[:5], vocab_size=2048)
    assert len(SPECIAL_TOKENS) + 256 < small.get_vocab_size() < 2048
