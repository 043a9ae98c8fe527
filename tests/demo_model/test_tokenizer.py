"""Tests for the demo model's tokenizer training, saving and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvserve.demo_model.corpus import SEARCH_HOTELS_TOOL, TOOL_SHARE, Conversation, generate_corpus
from kvserve.demo_model.tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    PLAIN_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
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
    return generate_corpus(2000, seed=0, tool_share=TOOL_SHARE)


@pytest.fixture(scope="module")
def texts(conversations: list[Conversation]) -> list[str]:
    return [render_conversation(c.messages, tools=c.tools) for c in conversations]


@pytest.fixture(scope="module")
def tok(texts: list[str]) -> Tokenizer:
    return train_tokenizer(texts, vocab_size=VOCAB, tool_tokens=True)


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


def test_tool_tokens_are_whole_and_survive_skipping_special_tokens(
    tok: Tokenizer, hf: PreTrainedTokenizerFast
) -> None:
    assert TOOL_TOKENS == ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
    for i, token in enumerate(TOOL_TOKENS, start=len(SPECIAL_TOKENS)):
        assert tok.token_to_id(token) == i
        assert hf.convert_tokens_to_ids(token) == i
        assert i not in hf.all_special_ids
    assert not [t for t in tok.get_vocab() if t not in TOOL_TOKENS and "tool_" in t]
    text = '<tool_call>\n{"name": "search_hotels", "arguments": {}}\n</tool_call><|end|>'
    ids = hf(text)["input_ids"]
    assert ids[0] == 6 and ids[-2:] == [7, 1]
    # The engine's detokenizer skips special tokens by default: the tags must stay.
    assert hf.decode(ids, skip_special_tokens=True) == text.removesuffix("<|end|>")
    assert tok.decode(ids, skip_special_tokens=True) == text.removesuffix("<|end|>")


def test_rendered_conversation_encodes_special_tokens_whole(
    conversations: list[Conversation], hf: PreTrainedTokenizerFast
) -> None:
    conv = next(c for c in conversations if c.messages[0]["role"] == "system" and not c.tools)
    ids = hf(render_conversation(conv.messages))["input_ids"]
    assert ids[:2] == [0, 2]  # bos, <|system|>: encode adds no bos of its own
    assert ids.count(1) == len(conv.messages)  # one <|end|> per message
    assert ids.count(4) == len(conv.requests)
    tools = next(c for c in conversations if c.tools)
    ids = hf(render_conversation(tools.messages, tools=tools.tools))["input_ids"]
    assert ids.count(1) == len(tools.messages) + (tools.messages[0]["role"] != "system")
    assert ids.count(4) == 2  # the call and the answer
    # <tool_call> twice (the system turn's instructions, the call), <tool_response> once.
    assert [ids.count(i) for i in (6, 7, 8, 9)] == [2, 2, 1, 1]


def test_round_trip(texts: list[str], tok: Tokenizer, hf: PreTrainedTokenizerFast) -> None:
    for text in texts[:300] + UNICODE_TEXTS:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
        assert hf.decode(hf(text)["input_ids"]) == text


def test_chat_template_matches_render_conversation(
    conversations: list[Conversation], hf: PreTrainedTokenizerFast
) -> None:
    assert hf.chat_template == CHAT_TEMPLATE
    picks = [
        next(c for c in conversations if c.messages[0]["role"] == "system" and not c.tools),
        next(c for c in conversations if c.messages[0]["role"] != "system" and not c.tools),
        next(c for c in conversations if len(c.requests) == 2),
        next(c for c in conversations if c.messages[0]["role"] == "system" and c.tools),
        next(c for c in conversations if c.messages[0]["role"] != "system" and c.tools),
        *conversations[:8],
    ]
    unicode_conv = [{"role": "user", "content": t} for t in UNICODE_TEXTS]
    cases = [(c.messages, c.tools) for c in picks] + [(unicode_conv, None)]
    cases += [(unicode_conv, [SEARCH_HOTELS_TOOL]), (OPENAI_SHAPED, [SEARCH_HOTELS_TOOL])]
    for messages, tools in cases:
        for prompt_only in (False, True):
            msgs = messages[:-1] if prompt_only else messages
            for gen in (False, True):
                rendered = hf.apply_chat_template(
                    msgs, tools=tools, tokenize=False, add_generation_prompt=gen
                )
                assert rendered == render_conversation(msgs, gen, tools)
    assert render_conversation([{"role": "user", "content": "hi"}], True) == (
        "<|begin_of_text|><|user|>\nhi<|end|>\n<|assistant|>\n"
    )


def test_without_tool_tokens_the_plain_template_renders_the_same(
    conversations: list[Conversation], tmp_path: Path
) -> None:
    # The bundled checkpoint's tokenizer: no tool tokens, the template without tools.
    plain = [c for c in conversations if not c.tools]
    tok = train_tokenizer([render_conversation(c.messages) for c in plain], vocab_size=VOCAB)
    assert tok.token_to_id("<tool_call>") is None
    hf = AutoTokenizer.from_pretrained(save_tokenizer(tok, tmp_path))
    assert hf.chat_template == PLAIN_CHAT_TEMPLATE
    for conv in plain[:20]:
        for gen in (False, True):
            rendered = hf.apply_chat_template(
                conv.messages, tokenize=False, add_generation_prompt=gen
            )
            assert rendered == render_conversation(conv.messages, gen)


def test_render_conversation_rejects_unknown_roles() -> None:
    with pytest.raises(ValueError):
        render_conversation([{"role": "function", "content": "x"}])


# What an OpenAI client replays: null content, arguments as a JSON string or a mapping,
# two calls in one turn with text before them, two tool results in a row.
_ARGS = {"city": "Kyoto", "max_price": 200, "kind": "ryokan", "amenities": ["onsen"]}
OPENAI_SHAPED: list[dict[str, object]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Ryokans in 京都 under $200 with an onsen?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "search_hotels", "arguments": json.dumps(_ARGS)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "No results in Kyoto under $50 a night."},
    {
        "role": "assistant",
        "content": "Let me look twice.",
        "tool_calls": [
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "search_hotels", "arguments": _ARGS},
            },
            {
                "id": "c3",
                "type": "function",
                "function": {"name": "search_hotels", "arguments": {}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "No results: Paris has no hot springs."},
    {"role": "tool", "tool_call_id": "c3", "content": None},
    {"role": "user", "content": "ok"},
]


def test_tool_calls_render_the_same_from_a_json_string_or_a_mapping() -> None:
    text = render_conversation(OPENAI_SHAPED, tools=[SEARCH_HOTELS_TOOL])
    call = '<tool_call>\n{"name": "search_hotels", "arguments": ' + json.dumps(_ARGS) + "}"
    assert text.count(call) == 2
    assert "<|assistant|>\nLet me look twice.\n<tool_call>" in text
    assert text.count("<|user|>\n<tool_response>") == 2  # two results share one user turn
    assert "</tool_response>\n<tool_response>\n\n</tool_response><|end|>" in text
    assert text.startswith(
        "<|begin_of_text|><|system|>\nBe brief.\n\nTools:\n<tools>\n"
        "search_hotels(city, max_price, kind, amenities)\n</tools>"
    )


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
