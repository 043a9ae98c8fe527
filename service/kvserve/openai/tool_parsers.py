"""Tool calls out of a model's text, incrementally: feed text deltas, get content and calls.

One parser per model family, with vLLM's names (``--tool-call-parser``):

* ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, with text around them;
* ``llama3_json`` (Llama 3.1+): the whole output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``.

Markers are read in the text. Where a tokenizer makes one a special token, which the
text leaves out (``skip_special_tokens``), the reader puts it back by its token id
(``TOOL_CALL_MARKERS``, ``openai/chat_output.py``).

The invariants, for every parser and every way of cutting the text into deltas:

* a call is emitted only once its text is complete and parses as a call of one of the
  request's tools with a JSON-object argument; any other text, a malformed or
  unfinished call included, is returned as content (never as a broken call);
* the content and calls emitted over a whole output are the same whatever the deltas
  were (streaming and non-streaming agree: ``tests/test_openai_chat_output.py``);
* text that may be the start of a marker is held back until it is known not to be.

Whitespace right before a call, and whitespace-only text after the last call, is a
separator, not content.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
# The texts each format's calls are marked with (some tokenizers make them special tokens).
TOOL_CALL_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]",),
}


@dataclass(frozen=True)
class ParsedToolCall:
    """One complete call: ``arguments`` is its JSON text (what OpenAI sends)."""

    id: str
    name: str
    arguments: str


@dataclass
class ToolParse:
    """What one delta (or the end) of the output adds: content text and complete calls."""

    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call(obj: Any, names: frozenset[str], args_key: str) -> ParsedToolCall | None:
    """A call from a decoded JSON value, or None if it is not a call of a known tool."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    if not isinstance(name, str) or name not in names or not isinstance(args, dict):
        return None
    return ParsedToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str) -> list[Any] | None:
    """The JSON values of ``text`` one after another (``separators`` and whitespace between
    them), or None if anything else is there."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class ToolCallParser:
    """The interface: ``feed`` each text delta, then ``finish`` once."""

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.names = tool_names
        self.num_calls = 0

    def feed(self, text: str) -> ToolParse:
        raise NotImplementedError

    def finish(self) -> ToolParse:
        raise NotImplementedError

    def _counted(self, parse: ToolParse) -> ToolParse:
        """``parse``, its calls counted."""
        self.num_calls += len(parse.calls)
        return parse


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.buffer = ""
        self.in_call = False

    def feed(self, text: str) -> ToolParse:
        self.buffer += text
        out = ToolParse()
        while True:
            if self.in_call:
                end = self.buffer.find(self.END)
                if end < 0:
                    break
                raw = self.buffer[: end + len(self.END)]  # the separator, then the call
                call = self._parse(raw.lstrip())
                if call is not None:  # the separator goes with it
                    out.calls.append(call)
                    self.num_calls += 1
                else:  # text, as written
                    out.content += raw
                self.buffer = self.buffer[end + len(self.END) :]
                self.in_call = False
            else:
                start = self.buffer.find(self.START)
                if start < 0:
                    keep = held_prefix(self.buffer, self.START)
                    head = self.buffer[: len(self.buffer) - keep]
                    visible = head.rstrip()  # trailing whitespace may separate a call
                    out.content += visible
                    self.buffer = self.buffer[len(visible) :]
                    break
                # Whitespace before the call waits with it: it separates a call, or is
                # text before a malformed or unfinished one.
                content = self.buffer[:start].rstrip()
                out.content += content
                self.buffer = self.buffer[len(content) :]
                self.in_call = True
        return out

    def finish(self) -> ToolParse:
        rest, self.buffer = self.buffer, ""
        if self.in_call or rest.strip() or self.num_calls == 0:
            return ToolParse(content=rest)  # an unfinished call is text
        return ToolParse()

    def _parse(self, raw: str) -> ParsedToolCall | None:
        body = raw[len(self.START) : -len(self.END)]
        values = _json_values(body, "")
        if values is None or len(values) != 1:
            return None
        return _call(values[0], self.names, "arguments")


class WholeOutputParser(ToolCallParser):
    """For formats whose calls make the whole rest of the output: text before them streams
    as content; from their start on, the text is held until the end and then parsed as
    calls, or returned as content if it does not parse."""

    args_key = "arguments"

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.buffer = ""
        self.holding = False

    def feed(self, text: str) -> ToolParse:
        self.buffer += text
        if self.holding:
            return ToolParse()
        start = self._start()
        if start is not None:
            content = self.buffer[:start].rstrip()
            self.buffer = self.buffer[len(content) :]
            self.holding = True
            return ToolParse(content=content)
        # Trailing whitespace waits too: it is a separator if calls follow it.
        visible = self.buffer[: len(self.buffer) - self._undecided()].rstrip()
        self.buffer = self.buffer[len(visible) :]
        return ToolParse(content=visible)

    def finish(self) -> ToolParse:
        rest, self.buffer = self.buffer, ""
        calls = self._calls(rest.strip()) if self.holding else []
        if not calls:
            return ToolParse(content=rest)
        return self._counted(ToolParse(calls=calls))

    def _start(self) -> int | None:
        """Where the calls begin in the buffer, if they have."""
        raise NotImplementedError

    def _undecided(self) -> int:
        """How much of the buffer's end to hold back (calls may be starting there)."""
        raise NotImplementedError

    def _calls(self, text: str) -> list[ParsedToolCall]:
        """The calls ``text`` (from the start of the calls on) makes; [] if not all parse."""
        raise NotImplementedError


class Llama3JsonParser(WholeOutputParser):
    """Calls only when the output begins with them: JSON objects (after optional
    whitespace and ``<|python_tag|>``), separated by ``;``."""

    TAG = "<|python_tag|>"
    args_key = "parameters"

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self.plain = False  # the output began with text: no calls can follow

    def _start(self) -> int | None:
        head = self.buffer.lstrip()
        if not self.plain and (head.startswith(self.TAG) or head.startswith("{")):
            return 0
        return None

    def _undecided(self) -> int:
        head = self.buffer.lstrip()
        if not self.plain and (not head or self.TAG.startswith(head)):
            return len(self.buffer)
        self.plain = True
        return 0

    def _calls(self, text: str) -> list[ParsedToolCall]:
        values = _json_values(text.removeprefix(self.TAG), ";")
        return _all_calls(values, self.names, self.args_key)


class MistralParser(WholeOutputParser):
    """``[TOOL_CALLS]`` anywhere, then one JSON list of calls to the end."""

    MARKER = "[TOOL_CALLS]"

    def _start(self) -> int | None:
        at = self.buffer.find(self.MARKER)
        return None if at < 0 else at

    def _undecided(self) -> int:
        return held_prefix(self.buffer, self.MARKER)

    def _calls(self, text: str) -> list[ParsedToolCall]:
        values = _json_values(text.removeprefix(self.MARKER), "")
        if values is None or len(values) != 1 or not isinstance(values[0], list):
            return []
        return _all_calls(values[0], self.names, self.args_key)


def _all_calls(
    values: list[Any] | None, names: frozenset[str], args_key: str
) -> list[ParsedToolCall]:
    """Every value as a call, or none at all if one of them is not a call."""
    if not values:
        return []
    calls = [_call(v, names, args_key) for v in values]
    return [c for c in calls if c is not None] if all(calls) else []


_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def make_tool_parser(name: str, tool_names: frozenset[str]) -> ToolCallParser:
    return _PARSERS[name](tool_names)


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template implies, where that is unambiguous (else None)."""
    if not chat_template:
        return None
    found = [
        name
        for name, mark in (("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]"))
        if mark in chat_template
    ]
    return found[0] if len(found) == 1 else None
