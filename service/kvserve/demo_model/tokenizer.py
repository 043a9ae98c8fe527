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

With ``tools`` (a tokenizer trained with ``tool_tokens``), the template renders them and tool
calls and results Hermes-style (see :data:`CHAT_TEMPLATE`); without the tool tokens the
tokenizer gets :data:`PLAIN_CHAT_TEMPLATE`, the bundled checkpoint's, which renders the same
text for conversations without tools.

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
    "PLAIN_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "SYSTEM_TOKEN",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "TOOL_RESPONSE_END",
    "TOOL_RESPONSE_START",
    "TOOL_TOKENS",
    "USER_TOKEN",
    "chat_template",
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
#: Markers of tool calls and results (Hermes style, as in Qwen2.5/Qwen3): added tokens at ids
#: 6-9, one token each, but not "special" -- ``decode(..., skip_special_tokens=True)``, which
#: the engine's detokenizer uses by default, keeps them, so a tool-call parser sees the tags.
TOOL_CALL_START: Final = "<tool_call>"
TOOL_CALL_END: Final = "</tool_call>"
TOOL_RESPONSE_START: Final = "<tool_response>"
TOOL_RESPONSE_END: Final = "</tool_response>"
TOOL_TOKENS: Final[tuple[str, ...]] = (
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOL_RESPONSE_START,
    TOOL_RESPONSE_END,
)
_ROLES: Final[frozenset[str]] = frozenset({"system", "user", "assistant", "tool"})

#: Default context length written to tokenizer_config.json (conversations are ~60-400 tokens).
MODEL_MAX_LENGTH: Final = 512

#: What the system turn says after the tool signatures (the same words as the template).
_TOOLS_INTRO: Final = "Tools:\n<tools>"
_TOOLS_OUTRO: Final = (
    '\n</tools>\nTo call one, answer <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>'
)

# Without ``tools`` it renders exactly what the model was first trained on. With ``tools``
# (Hermes/Qwen2.5 structure): the system turn (the first system message's text, a blank
# line) lists each tool as a signature, name(param, ...), inside <tools></tools>; an
# assistant turn with ``tool_calls`` renders each call as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> (arguments given as a mapping
# go through ``tojson``; a JSON string is written as it is, the same text when it is the
# model's own output); consecutive ``tool`` messages share one user turn, each result
# inside <tool_response>\n...\n</tool_response>. Content may be null.
CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ (messages[0]['content'] or '') + '\n\n' }}"
    "{% endif %}"
    "{{ '" + _TOOLS_INTRO.replace("\n", "\\n") + "' }}"
    "{% for tool in tools %}"
    "{% set fn = tool['function'] if tool['function'] is defined else tool %}"
    "{{ '\n' + fn['name'] + '(' }}"
    "{% if fn['parameters'] and fn['parameters']['properties'] %}"
    "{{ fn['parameters']['properties'] | list | join(', ') }}{% endif %}"
    "{{ ')' }}"
    "{% endfor %}"
    "{{ '" + _TOOLS_OUTRO.replace("\n", "\\n") + "<|end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|user|>\n' }}{% else %}{{ '\n' }}{% endif %}"
    "{{ '<tool_response>\n' + (message['content'] or '') + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|assistant|>\n' }}"
    "{% if message['content'] %}{{ message['content'] + '\n' }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}"
    "{% if fn['arguments'] is string %}{{ fn['arguments'] }}"
    "{% else %}{{ fn['arguments'] | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|end|>\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') + '<|end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

#: The template of a tokenizer trained without :data:`TOOL_TOKENS` (the bundled checkpoint's):
#: no tools; the same text as :data:`CHAT_TEMPLATE` renders for conversations without them.
PLAIN_CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def chat_template(tok: Tokenizer) -> str:
    """The template for ``tok``: :data:`CHAT_TEMPLATE` when it has the tool tokens."""
    return CHAT_TEMPLATE if tok.token_to_id(TOOL_CALL_START) is not None else PLAIN_CHAT_TEMPLATE


def _text(content: Any) -> str:
    return "" if content is None else str(content)


def _json(value: Any) -> str:
    """What the template's ``tojson`` writes (Hugging Face's: ``json.dumps``, no ASCII escapes)."""
    return json.dumps(value, ensure_ascii=False)


def _signature(tool: Mapping[str, Any]) -> str:
    """A tool as the template lists it: ``name(param, ...)``, its parameters' names in
    their schema's order (the JSON schema itself would add ~140 tokens to a tool
    conversation of ~230, paid in every training step: the tiny model knows its one tool's types
    from the conversations)."""
    fn = tool.get("function", tool)
    properties = (fn.get("parameters") or {}).get("properties") or {}
    return f"{fn['name']}({', '.join(properties)})"


def _tool_call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function", call)
    args = fn["arguments"]
    args_text = args if isinstance(args, str) else _json(args)
    text = f'{{"name": {_json(fn["name"])}, "arguments": {args_text}}}'
    return f"{TOOL_CALL_START}\n{text}\n{TOOL_CALL_END}"


def render_conversation(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The text :data:`CHAT_TEMPLATE` renders for ``messages`` and ``tools`` (the training
    text format)."""
    parts = [BOS_TOKEN]
    start = 0
    if tools:
        system = ""
        if messages and messages[0]["role"] == "system":
            system = _text(messages[0]["content"]) + "\n\n"
            start = 1
        signatures = "".join("\n" + _signature(tool) for tool in tools)
        parts.append(
            f"{SYSTEM_TOKEN}\n{system}{_TOOLS_INTRO}{signatures}{_TOOLS_OUTRO}{EOS_TOKEN}\n"
        )
    for i in range(start, len(messages)):
        message = messages[i]
        role = message["role"]
        if role not in _ROLES:
            raise ValueError(f"unknown role {role!r}")
        if role == "tool":
            first = i == 0 or messages[i - 1]["role"] != "tool"
            last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
            parts.append(f"{USER_TOKEN}\n" if first else "\n")
            parts.append(f"{TOOL_RESPONSE_START}\n{_text(message['content'])}\n{TOOL_RESPONSE_END}")
            parts.append(f"{EOS_TOKEN}\n" if last else "")
        elif role == "assistant" and message.get("tool_calls"):
            content = message.get("content")
            lead = f"{content}\n" if content else ""
            calls = "\n".join(_tool_call_text(c) for c in message["tool_calls"])
            parts.append(f"{ASSISTANT_TOKEN}\n{lead}{calls}{EOS_TOKEN}\n")
        else:
            parts.append(f"<|{role}|>\n{_text(message['content'])}{EOS_TOKEN}\n")
    if add_generation_prompt:
        parts.append(f"{ASSISTANT_TOKEN}\n")
    return "".join(parts)


def _special(token: str) -> AddedToken:
    return AddedToken(token, special=True, normalized=False, single_word=False, lstrip=False)


_SPECIAL_RE: Final = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TOKENS))


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


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 2048, tool_tokens: bool = False
) -> Tokenizer:
    """Train byte-level BPE on ``texts`` (e.g. rendered conversations); deterministic.

    Ids 0-5 are :data:`SPECIAL_TOKENS` (never split, never merged with text); with
    ``tool_tokens``, ids 6-9 are :data:`TOOL_TOKENS` (never split either, but not special);
    then the 256 byte symbols, then the merges up to ``vocab_size`` (fewer if the texts have
    fewer pairs).
    ``encode`` adds no BOS/EOS: the chat template writes them.
    """
    added = SPECIAL_TOKENS + (TOOL_TOKENS if tool_tokens else ())
    tok = train_byte_level_bpe(_without_special_tokens(texts), vocab_size, added, min_frequency=2)
    for i, token in enumerate(added):
        if tok.token_to_id(token) != i:  # pragma: no cover - guaranteed by the trainer
            raise AssertionError(f"added token {token!r} did not get id {i}")
    return _tool_tokens_not_special(tok) if tool_tokens else tok


def _tool_tokens_not_special(tok: Tokenizer) -> Tokenizer:
    """``tok`` with :data:`TOOL_TOKENS` kept whole but not flagged special (the trainer flags
    every token it is given as special; a decode that skips special tokens must keep these)."""
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        if added["content"] in TOOL_TOKENS:
            added["special"] = False
    return Tokenizer.from_str(json.dumps(data))


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
        "chat_template": chat_template(tok),
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    _dump_json(config, out / "tokenizer_config.json", sort_keys=True)
    _dump_json(special_map, out / "special_tokens_map.json", sort_keys=True)
    return out
