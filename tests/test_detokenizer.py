"""Tests for the incremental detokenizer and the offline test tokenizers."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.testing.tokenizers import (
    build_byte_fallback_tokenizer,
    build_byte_level_tokenizer,
    save_tokenizer,
)

BYTE_LEVEL = build_byte_level_tokenizer()
BYTE_FALLBACK = build_byte_fallback_tokenizer()
TOKENIZERS = {"byte_level": BYTE_LEVEL, "byte_fallback": BYTE_FALLBACK}

FIXED_TEXTS = [
    "你好，世界",
    "héllo wörld",
    "👩‍👩‍👧 family 🎉",
    "  leading spaces",
    " ",
    "",
    "The quick brown fox, 中文 and café — ❤️ 🇩🇪 a\u0301 Привет!\n\tend ",
    "the hello world. the other hello world",
    "\ufffd literal replacement char \ufffd",
    "▁ literal metaspace ▁▁",
    "<s> and <|eos|> as text",
]

HYPO = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def full_decode(tok: PreTrainedTokenizerBase, ids: Sequence[int], skip: bool = True) -> str:
    out = tok.decode(list(ids), skip_special_tokens=skip)
    assert isinstance(out, str)
    return out


def encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def chunked(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    out: list[list[int]] = []
    pos = 0
    i = 0
    while pos < len(ids):
        n = sizes[i % len(sizes)] if sizes else 1
        out.append(list(ids[pos : pos + n]))
        pos += n
        i += 1
    return out


def stream(
    tok: PreTrainedTokenizerBase,
    ids: Sequence[int],
    sizes: Sequence[int] = (1,),
    **kwargs: Any,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed `ids` in chunks; finish with an empty update. Returns (detok, deltas, stop)."""
    d = IncrementalDetokenizer(tok, **kwargs)
    deltas: list[str] = []
    for chunk in chunked(ids, sizes):
        matched = d.update(chunk)
        deltas.append(d.delta_text)
        assert d.text == "".join(deltas)
        if matched is not None:
            assert d.finished
            return d, deltas, matched
    matched = d.update([], finished=True)
    deltas.append(d.delta_text)
    assert d.finished
    return d, deltas, matched


def assert_stream_matches_full(
    tok: PreTrainedTokenizerBase, ids: Sequence[int], deltas: list[str], d: IncrementalDetokenizer
) -> None:
    full = full_decode(tok, ids, d.skip_special_tokens)
    assert "".join(deltas) == d.text == full
    # Every delta is exactly the corresponding slice of the full decode, so no delta carries a
    # replacement character (partial UTF-8) unless the final text has one at that position.
    pos = 0
    for delta in deltas:
        assert full[pos : pos + len(delta)] == delta
        pos += len(delta)
    assert d._corrections == 0
    assert not d._diverged


# --------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_tokenizers_are_deterministic(name: str) -> None:
    build = build_byte_level_tokenizer if name == "byte_level" else build_byte_fallback_tokenizer
    a, b = build(), build()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert encode(a, FIXED_TEXTS[6]) == encode(b, FIXED_TEXTS[6])


def test_byte_level_special_ids_and_size() -> None:
    tok = BYTE_LEVEL
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert len(tok) == 512
    assert len(build_byte_level_tokenizer(300)) == 300


def test_byte_fallback_vocab_and_bytes() -> None:
    tok = BYTE_FALLBACK
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 258]) == [
        "<unk>",
        "<s>",
        "</s>",
        "<0x00>",
        "<0xFF>",
    ]
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    ids = encode(tok, "你好 the")
    assert tok.convert_ids_to_tokens(ids) == [
        "▁",
        "<0xE4>",
        "<0xBD>",
        "<0xA0>",
        "<0xE5>",
        "<0xA5>",
        "<0xBD>",
        "▁the",
    ]
    assert tok.decode(ids) == "你好 the"
    assert tok.encode("hi")[0] == tok.bos_token_id  # Llama-style BOS
    assert tok.unk_token_id not in tok.encode("😀 \x00 \u00e9 \U0010ffff")


@given(text=st.text())
@HYPO
def test_byte_level_round_trips_any_text(text: str) -> None:
    assert BYTE_LEVEL.decode(encode(BYTE_LEVEL, text)) == text


@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_characters="▁<")))
@HYPO
def test_byte_fallback_round_trips(text: str) -> None:
    assert BYTE_FALLBACK.decode(BYTE_FALLBACK.encode(text), skip_special_tokens=True) == text


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_save_and_reload_with_auto_tokenizer(name: str, tmp_path: Path) -> None:
    tok = TOKENIZERS[name]
    save_tokenizer(tok, tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in [*FIXED_TEXTS, "x <|bos|> y </s> z <s>"]:
        assert reloaded.encode(text) == tok.encode(text)
        assert reloaded.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert reloaded.all_special_ids == tok.all_special_ids
    assert (reloaded.bos_token_id, reloaded.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert isinstance(rendered, str) and "hi" in rendered and "yo" in rendered
    assert rendered.startswith(tok.bos_token)
    assert reloaded.apply_chat_template(messages, tokenize=False) == rendered


def test_chat_template_generation_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}]
    with_prompt = BYTE_LEVEL.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert isinstance(with_prompt, str) and with_prompt.endswith("<|assistant|>\n")
    assert with_prompt == "<|bos|><|user|>\nhi<|eos|>\n<|assistant|>\n"
    llama = BYTE_FALLBACK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert llama == "<s>[INST] hi [/INST]"


# --------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("text", FIXED_TEXTS)
def test_token_by_token_matches_full_decode(name: str, text: str) -> None:
    tok = TOKENIZERS[name]
    ids = encode(tok, text)
    d, deltas, matched = stream(tok, ids)
    assert matched is None
    assert d.token_ids == ids
    assert_stream_matches_full(tok, ids, deltas, d)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_partial_characters_are_held_back(name: str) -> None:
    tok = TOKENIZERS[name]
    ids = encode(tok, "你")
    assert len(ids) > 1  # split into bytes
    d = IncrementalDetokenizer(tok)
    for t in ids[:-1]:
        d.update([t])
        assert "\ufffd" not in d.text
    d.update(ids[-1:])
    assert d.text == "你"


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_flush_of_incomplete_character_matches_full_decode(name: str) -> None:
    tok = TOKENIZERS[name]
    ids = encode(tok, "ab 你")[:-1]  # cut the last byte of 你
    d, deltas, _ = stream(tok, ids)
    assert d.text.endswith("\ufffd")
    assert "\ufffd" not in "".join(deltas[:-1])  # only the final flush shows it
    assert_stream_matches_full(tok, ids, deltas, d)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_special_tokens_in_the_middle_are_skipped(name: str) -> None:
    tok = TOKENIZERS[name]
    specials = list(tok.all_special_ids)
    ids = encode(tok, "hello world 你好")
    mixed = [specials[0], *ids[:2], *specials, ids[2], specials[-1], *ids[3:], specials[0]]
    d, deltas, _ = stream(tok, mixed)
    assert_stream_matches_full(tok, mixed, deltas, d)
    assert d.text == "hello world 你好"
    kept, kept_deltas, _ = stream(tok, mixed, skip_special_tokens=False)
    assert_stream_matches_full(tok, mixed, kept_deltas, kept)
    assert tok.bos_token in kept.text


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@given(
    text=st.text(),
    sizes=st.lists(st.integers(1, 8), min_size=1, max_size=6),
    special_positions=st.lists(st.integers(0, 10_000), max_size=3),
)
@HYPO
def test_random_text_random_chunks(
    name: str, text: str, sizes: list[int], special_positions: list[int]
) -> None:
    tok = TOKENIZERS[name]
    ids = encode(tok, text)
    for pos in special_positions:
        ids.insert(pos % (len(ids) + 1), tok.eos_token_id)
    d, deltas, matched = stream(tok, ids, sizes)
    assert matched is None
    assert d.token_ids == ids
    assert_stream_matches_full(tok, ids, deltas, d)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_finished_on_last_real_chunk(name: str) -> None:
    tok = TOKENIZERS[name]
    ids = encode(tok, "👩‍👩‍👧 done")
    d = IncrementalDetokenizer(tok)
    deltas = []
    for i, t in enumerate(ids):
        d.update([t], finished=i == len(ids) - 1)
        deltas.append(d.delta_text)
    assert d.finished
    assert_stream_matches_full(tok, ids, deltas, d)
    # Further updates after finishing are ignored.
    assert d.update(encode(tok, "more")) is None
    assert d.delta_text == "" and d.text == "👩‍👩‍👧 done"


def test_windows_stay_small() -> None:
    """Per-step decodes must cover a constant-size window, not the whole output."""
    tok = BYTE_FALLBACK
    lengths: list[int] = []
    ids = encode(tok, "the hello world 你好 🎉 " * 100)
    d = IncrementalDetokenizer(tok, stop=["xyz"])
    original = d._decode

    def recording_decode(ids: Sequence[int]) -> str:
        lengths.append(len(ids))
        return original(ids)

    setattr(d, "_decode", recording_decode)  # noqa: B010
    for t in ids:
        d.update([t])
    per_step_max = max(lengths)
    d.update([], finished=True)
    assert per_step_max <= 10
    assert len(lengths) <= 2 * len(ids) + 2
    assert d.text == tok.decode(ids)


# --------------------------------------------------------------------------- stop strings


def expected_stop(full: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Reference: the stop string that completes first (longest on ties)."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        if not s:
            continue
        idx = full.find(s)
        if idx >= 0:
            cand = (idx + len(s), -len(s), s)
            best = cand if best is None or cand < best else best
    if best is None:
        return full, None
    end, neg_len, s = best
    return full[: end if include else end + neg_len], s


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    ("text", "stops"),
    [
        ("the hello world and more", ["world"]),  # spans several tokens
        ("the hello world and more", ["lo wo"]),  # starts mid-token
        ("the hello world and more", ["hello", "world"]),
        ("the hello world and more", ["world", "o w"]),  # "o w" completes first
        ("the hello world and more", ["the"]),  # at the very start
        ("the hello world and more", ["t"]),
        ("the hello world and more", ["xyz", "worlds", "moree"]),  # never matches
        ("the hello world and more", ["and more"]),  # at the very end
        ("你好，世界！再见", ["世界"]),
        ("你好，世界！再见", ["界！再"]),
        ("emoji 👩‍👩‍👧 family", ["\u200d👩"]),
        ("abcabcabd", ["abcabd"]),  # overlapping partial matches
        ("aaaa", ["aaaaa"]),
    ],
)
def test_stop_strings(name: str, include: bool, text: str, stops: list[str]) -> None:
    tok = TOKENIZERS[name]
    ids = encode(tok, text)
    full = full_decode(tok, ids)
    want_text, want_stop = expected_stop(full, stops, include)
    for sizes in ([1], [2, 3], [len(ids) or 1]):
        d, deltas, matched = stream(tok, ids, sizes, stop=stops, include_stop_str_in_output=include)
        assert matched == want_stop
        assert d.matched_stop == want_stop
        assert "".join(deltas) == d.text == want_text
        if not include:
            for s in stops:
                assert s not in d.text
                assert all(s not in delta for delta in deltas)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_stop_prefix_is_held_then_released(name: str) -> None:
    tok = TOKENIZERS[name]
    ids = encode(tok, "hello wor")
    d = IncrementalDetokenizer(tok, stop=["world"])
    for t in ids:
        assert d.update([t]) is None
        assert not d.text.endswith(("w", "wo", "wor"))
    assert d.text == "hello "
    assert d.update([], finished=True) is None
    assert d.delta_text == "wor"
    assert d.text == "hello wor"


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_stop_in_middle_of_multi_token_update(name: str) -> None:
    tok = TOKENIZERS[name]
    ids = encode(tok, "one STOP two STOP three")
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    assert d.update(ids) == "STOP"
    assert d.text == d.delta_text == "one "
    assert d.finished


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@given(
    data=st.data(),
    text=st.text(min_size=1),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    include=st.booleans(),
)
@HYPO
def test_random_stop_strings(
    name: str, data: st.DataObject, text: str, sizes: list[int], include: bool
) -> None:
    tok = TOKENIZERS[name]
    ids = encode(tok, text)
    full = full_decode(tok, ids)
    stops: list[str] = []
    for _ in range(data.draw(st.integers(1, 3))):
        if full and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(full) - 1))
            j = data.draw(st.integers(i + 1, min(len(full), i + 6)))
            stops.append(full[i:j])
        else:
            stops.append(data.draw(st.text(min_size=1, max_size=4)))
    want_text, want_stop = expected_stop(full, stops, include)
    d, deltas, matched = stream(tok, ids, sizes, stop=stops, include_stop_str_in_output=include)
    assert matched == want_stop
    assert "".join(deltas) == d.text == want_text
    if not include:
        for delta in deltas:
            assert all(s not in delta for s in stops)


def test_empty_stop_strings_are_ignored() -> None:
    ids = encode(BYTE_LEVEL, "abc")
    d, _, matched = stream(BYTE_LEVEL, ids, stop=["", "zz"])
    assert matched is None and d.text == "abc"
    with pytest.raises(TypeError):
        IncrementalDetokenizer(BYTE_LEVEL, stop="abc")


# --------------------------------------------------------------------------- robustness


def test_finish_correction_path() -> None:
    """If the full decode differs only in not-yet-visible text, the full decode wins."""
    tok = build_byte_level_tokenizer()
    ids = encode(tok, "hello world")
    original = tok.decode

    def decode(token_ids: list[int], **kwargs: Any) -> Any:
        out = original(token_ids, **kwargs)
        assert isinstance(out, str)
        return out + "!" if len(token_ids) == len(ids) else out

    setattr(tok, "decode", decode)  # noqa: B010
    d, deltas, _ = stream(tok, ids)
    assert d.text == "".join(deltas) == "hello world!"
    assert d._corrections == 1


def test_correction_is_rescanned_for_stop_strings() -> None:
    tok = build_byte_level_tokenizer()
    ids = encode(tok, "hello world")
    original = tok.decode

    def decode(token_ids: list[int], **kwargs: Any) -> Any:
        out = original(token_ids, **kwargs)
        assert isinstance(out, str)
        return out + "STOP tail" if len(token_ids) == len(ids) else out

    setattr(tok, "decode", decode)  # noqa: B010
    d, deltas, matched = stream(tok, ids, stop=["STOP"])
    assert matched == "STOP"
    assert d.text == "".join(deltas) == "hello world"


def test_invalid_byte_sequence_keeps_stream_consistent() -> None:
    """A byte-fallback group that turns invalid after a valid prefix was shown cannot be
    taken back; the stream must stay self-consistent and not crash."""
    tok = BYTE_FALLBACK
    vocab = tok.get_vocab()
    ids = [vocab[t] for t in ("<0xE4>", "<0xBD>", "<0xA0>", "<0xBD>")] + encode(tok, "ok")
    d, deltas, _ = stream(tok, ids)
    assert "".join(deltas) == d.text
    assert d.text.startswith("你")
    assert d.text.endswith("ok")
    assert d._diverged  # the full decode is "\ufffd" * 4 + "ok": not prefix-stable


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@given(
    ids=st.lists(st.integers(0, 400), max_size=40),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=3),
)
@HYPO
def test_random_token_ids(name: str, ids: list[int], sizes: list[int]) -> None:
    """Arbitrary ids (as a random model would produce): deltas always concatenate to the
    text; for the byte-level tokenizer the text also equals the full decode."""
    tok = TOKENIZERS[name]
    d, deltas, _ = stream(tok, ids, sizes)
    assert "".join(deltas) == d.text
    if name == "byte_level":
        assert_stream_matches_full(tok, ids, deltas, d)


def test_random_long_generation_matches() -> None:
    rng = random.Random(0)
    tok = BYTE_LEVEL
    ids = [rng.randrange(len(tok)) for _ in range(2000)]
    d, deltas, _ = stream(tok, ids, [1, 2, 7])
    assert_stream_matches_full(tok, ids, deltas, d)


def test_plain_fast_tokenizers_decode_through_the_rust_tokenizer() -> None:
    """The per-token decodes skip transformers' wrapper only where it adds nothing."""
    assert IncrementalDetokenizer(build_byte_level_tokenizer())._backend is not None
    cleaning = build_byte_level_tokenizer()
    cleaning.clean_up_tokenization_spaces = True  # the wrapper rewrites spaces: keep it
    assert IncrementalDetokenizer(cleaning)._backend is None
    overridden = build_byte_level_tokenizer()
    setattr(overridden, "decode", lambda ids, **kw: "x")  # noqa: B010
    assert IncrementalDetokenizer(overridden)._backend is None
    d = IncrementalDetokenizer(BYTE_FALLBACK)
    ids = encode(BYTE_FALLBACK, "the hello world 你好 🎉")
    d.update(ids, finished=True)
    assert d.text == BYTE_FALLBACK.decode(ids, skip_special_tokens=True)
