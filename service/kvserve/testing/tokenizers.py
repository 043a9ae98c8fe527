"""Tiny, deterministic, fully offline tokenizers for tests, demos and benchmarks.

Two flavours that cover the decoding behaviours an inference engine must get right:

* :func:`build_byte_level_tokenizer` -- GPT-2 style byte-level BPE (``Ġ``-style byte alphabet,
  ``ByteLevel`` pre-tokenizer/decoder). Every byte sequence is representable, so any Unicode
  text round-trips exactly; multi-byte characters are often split across tokens.
* :func:`build_byte_fallback_tokenizer` -- Llama / SentencePiece style BPE with
  ``byte_fallback=True``: spaces become ``▁``, a ``▁`` is prepended to the input, characters
  outside the (ASCII-only) vocabulary become ``<0xNN>`` byte tokens, and the decoder strips the
  one leading space again.

Nothing is downloaded: the byte-level model is trained in-process on a small built-in corpus and
the byte-fallback model is written out by hand. Both builds are deterministic and take well under
a second.
"""

from __future__ import annotations

import os
import string

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    processors,
)
from transformers import PreTrainedTokenizerFast

__all__ = [
    "BYTE_FALLBACK_CHAT_TEMPLATE",
    "BYTE_LEVEL_CHAT_TEMPLATE",
    "BYTE_LEVEL_MISTRAL_TOOLS_CHAT_TEMPLATE",
    "BYTE_LEVEL_TOOLS_CHAT_TEMPLATE",
    "MISTRAL_TOOL_MARKER",
    "TRAINING_CORPUS",
    "build_byte_fallback_tokenizer",
    "build_byte_level_tokenizer",
    "save_tokenizer",
]

#: Small deterministic training corpus for the byte-level BPE (English plus some mixed text).
TRAINING_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog does not mind; it is a very lazy dog.
A large language model predicts the next token from the tokens that came before it. During
generation the server keeps a cache of keys and values for every token, so that each new token
only needs attention over the cached entries instead of the whole sequence again.
The scheduler batches many requests together. When the cache is full, the newest requests are
preempted and their blocks are freed; they are resumed later, when memory becomes available.
Streaming responses send the text to the client as soon as it is known, one piece at a time.

Hello, world! How are you today? I am fine, thank you. What is the weather like in the city?
It is sunny and warm, with a light wind from the west. Tomorrow there will be rain in the north.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 3.14159 -7 +12 1e-5 50% $9.99.

def generate(prompt, max_tokens=16, temperature=0.0):
    tokens = tokenizer.encode(prompt)
    for step in range(max_tokens):
        logits = model(tokens)
        tokens.append(sample(logits, temperature))
    return tokenizer.decode(tokens)

{"role": "user", "content": "Summarize the text in one sentence."}
Mixed text: café, naïve, résumé, jalapeño, Zürich, Ångström, façade, déjà vu, smörgåsbord.
Deutsch: Grüße aus München! Français: Où est la bibliothèque ? Español: ¿Dónde está el baño?
中文：你好，世界！今天天气很好。我们在学习语言模型。日本語：こんにちは、世界。
Русский: Привет, мир! Ελληνικά: Γειά σου κόσμε! Emoji: 🙂 🎉 👍 ❤️ 🚀 👩‍👩‍👧
"""

BYTE_LEVEL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# The byte-level template with tools in the Hermes / Qwen2.5 style: the tools' JSON in the
# system turn, an assistant's calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>
# (the arguments a mapping rendered with tojson, as those templates do), tool results in a
# user turn inside <tool_response>. Its "<tool_call>" makes the server pick the hermes parser.
BYTE_LEVEL_TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{- '<|system|>\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call these functions:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools>\\nTo call one, answer <tool_call>\\n"
    '{"name": <name>, "arguments": <JSON object>}\\n</tool_call>\' + eos_token + \'\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|system|>\\n' + messages[0]['content'] + eos_token + '\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- call['function']['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- eos_token + '\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>'"
    " + eos_token + '\\n' }}"
    "{%- elif message['role'] != 'system' or not loop.first %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

# Tools in the Mistral style: calls are "[TOOL_CALLS]" then a JSON list, and the marker
# is a special token (MISTRAL_TOOL_MARKER), which decoding with skip_special_tokens drops
# from the text, as Mistral's own tokenizers do. Its "[TOOL_CALLS]" makes the server pick
# the mistral parser.
MISTRAL_TOOL_MARKER = "[TOOL_CALLS]"
BYTE_LEVEL_MISTRAL_TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{- '<|system|>\\nYou may call these functions:\\n' + (tools | tojson) + '\\nTo call "
    "them, answer [TOOL_CALLS] then a JSON list of calls.' + eos_token + '\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\\n' + (message['content'] or '') }}"
    "{%- if message['tool_calls'] %}"
    "{{- '[TOOL_CALLS]' }}{{- message['tool_calls'] | map(attribute='function') | list | tojson }}"
    "{%- endif %}"
    "{{- eos_token + '\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|user|>\\n[TOOL_RESULTS]' + message['content'] + eos_token + '\\n' }}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

BYTE_FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)

_BYTE_LEVEL_SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]


def build_byte_level_tokenizer(
    vocab_size: int = 512,
    chat_template: str = BYTE_LEVEL_CHAT_TEMPLATE,
    extra_special: tuple[str, ...] = (),
) -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE trained on :data:`TRAINING_CORPUS`.

    Special tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` have ids 0, 1, 2 (followed by the
    chat-role markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``), then the 256 byte tokens,
    then merges up to ``vocab_size``. ``len(tok) == vocab_size`` for sizes up to ~900; the small
    corpus caps larger requests (fewer merges exist), so use ``len(tok)`` as the model's vocab size.
    No BOS/EOS is added by ``encode`` (like GPT-2).
    ``decode(encode(s)) == s`` for every string ``s``.
    ``extra_special``: more special tokens, with the ids after the others.
    """
    from kvserve.demo_model.tokenizer import train_byte_level_bpe

    tok = train_byte_level_bpe(
        TRAINING_CORPUS.splitlines(keepends=True), vocab_size, _BYTE_LEVEL_SPECIAL, 1
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=_BYTE_LEVEL_SPECIAL[3:],
        clean_up_tokenization_spaces=False,
        chat_template=chat_template,
        model_max_length=4096,
    )
    if extra_special:
        added = [AddedToken(t, special=True, normalized=False) for t in extra_special]
        fast.add_tokens(added, special_tokens=True)
    return fast


# Merges of the hand-written byte-fallback BPE, in priority order. Each merged piece is added to
# the vocabulary right after the single characters.
_BYTE_FALLBACK_MERGES: tuple[tuple[str, str], ...] = (
    ("▁", "t"),
    ("h", "e"),
    ("▁", "a"),
    ("i", "n"),
    ("▁t", "h"),
    ("e", "r"),
    ("o", "n"),
    ("▁", "s"),
    ("▁", "w"),
    ("r", "e"),
    ("a", "n"),
    ("▁", "o"),
    ("▁", "i"),
    ("e", "n"),
    ("o", "r"),
    ("l", "l"),
    ("▁th", "e"),
    ("▁t", "he"),
    ("in", "g"),
    ("▁", "c"),
    ("▁", "b"),
    ("▁", "f"),
    ("▁", "m"),
    ("▁", "p"),
    ("▁", "h"),
    ("▁", "d"),
    ("e", "s"),
    ("i", "s"),
    ("a", "t"),
    ("o", "u"),
    ("e", "d"),
    ("▁i", "s"),
    ("▁i", "n"),
    ("▁a", "n"),
    ("▁an", "d"),
    ("▁t", "o"),
    ("▁o", "f"),
    ("▁w", "or"),
    ("l", "d"),
    ("▁wor", "ld"),
    ("▁h", "e"),
    ("he", "ll"),
    ("hell", "o"),
    ("▁", "hello"),
    ("▁", "▁"),
    ("▁▁", "▁▁"),
    ("▁", "1"),
    ("0", "0"),
)


def _byte_fallback_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    pieces: list[str] = ["<unk>", "<s>", "</s>"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    pieces.append("▁")
    printable = string.ascii_letters + string.digits + string.punctuation
    pieces += [c for c in printable if c not in pieces]
    for left, right in _BYTE_FALLBACK_MERGES:
        if left not in pieces or right not in pieces:  # pragma: no cover - table is static
            raise AssertionError(f"merge ({left!r}, {right!r}) uses a piece not in the vocab")
        merged = left + right
        if merged not in pieces:
            pieces.append(merged)
    vocab = {piece: i for i, piece in enumerate(pieces)}
    return vocab, list(_BYTE_FALLBACK_MERGES)


def build_byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2 / SentencePiece style BPE with byte fallback, built by hand.

    Ids: ``<unk>``=0, ``<s>``=1, ``</s>``=2, ``<0x00>``..``<0xFF>``=3..258, then ``▁``, the ASCII
    letters/digits/punctuation and a few merged pieces. Characters outside the vocabulary
    (CJK, emoji, accented letters, control characters such as ``\\n``) are encoded as their
    UTF-8 bytes. Like Llama, ``encode`` prepends ``<s>`` unless ``add_special_tokens=False``;
    the decoder removes the single ``▁`` that the normalizer prepends.
    """
    vocab, merges = _byte_fallback_vocab()
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        chat_template=BYTE_FALLBACK_CHAT_TEMPLATE,
        model_max_length=4096,
    )


def save_tokenizer(tok: PreTrainedTokenizerFast, path: str | os.PathLike[str]) -> None:
    """Save ``tok`` so that ``transformers.AutoTokenizer.from_pretrained(path)`` reloads it."""
    tok.save_pretrained(path)
