"""Tool calls read as deltas: streamed argument by argument when a grammar forces them.

With ``tool_choice`` "required", a named function or a ``strict`` tool, the output is
constrained by ``openai/tool_grammar.py``, so a call that has begun will parse (unless
the output is cut short). ``StreamedCalls`` sends its deltas as the model writes it, in
OpenAI's shape: once the call's name is read, a header (``index``, ``id``, ``name``, no
arguments yet), then fragments that append to ``function.arguments``.

The fragments spell the arguments exactly as a whole answer does (``json.dumps`` of the
decoded object, ``ensure_ascii=False``): ``CanonicalJson`` re-spells the model's JSON as
it arrives (the grammar already writes ``json.dumps``'s separators; escapes and numbers
may differ), so streamed and whole answers agree, and nothing sent is taken back.

Output that does not begin like a call (in "auto" with a strict tool, text may come
instead) is read by the format's whole-call parser (``openai/tool_parsers.py``), as are
all outputs without a grammar (``WholeCalls``): there a call is sent only once it is
complete and parses, header and all its arguments at once, because unconstrained text
that looks like a call may still turn out not to be one (it is then content).

A call cut short (``max_tokens``, a stop string) keeps what was written, down to the
digits of a number it was inside: its arguments are incomplete, and the finish reason
("length", or "stop" for a stop string) says so, as in OpenAI's API. Text of a call cut
before its name was read is content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvserve.openai.format import ToolCallDelta
from kvserve.openai.tool_parsers import ToolCallParser, ToolParse, make_tool_parser, new_call_id

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b"}
_ESCAPES["\f"] = "\\f"
_UNESCAPE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r"}
_UNESCAPE["t"] = "\t"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_CLOSER = {"{": "}", "[": "]"}
_WHITESPACE = frozenset(" \t\n\r")


def _spelled(char: str) -> str:
    """``char`` inside a JSON string as ``json.dumps(..., ensure_ascii=False)`` spells it."""
    if char in _ESCAPES:
        return _ESCAPES[char]
    return f"\\u{ord(char):04x}" if char < " " else char


class JsonError(ValueError):
    """The text is not JSON (a grammar-forced call never gets here)."""


class CanonicalJson:
    """Reads one JSON value character by character and spells it as ``json.dumps`` of
    its decoded value would (``ensure_ascii=False``, separators ``", "`` and ``": "``).

    ``feed`` returns how much of the text the value took (it stops at the value's end);
    what became certain goes to ``emit``, with the depth it is at (the number of open
    containers around it) and whether it is a ``"key"``, a ``"sep"`` (``,`` ``:``) or
    part of a ``"value"``. A string's characters are emitted as they are read; a number
    or a literal once it is complete (a number's spelling depends on all its digits).
    """

    def __init__(self) -> None:
        self.stack: list[str] = []  # the closers of the open containers
        self.state = "value"
        self.token = ""  # a number, a literal or an escape being read
        self.high: int | None = None  # a \\u high surrogate waiting for its low half
        self.in_key = False
        self.done = False

    def emit(self, text: str, depth: int, part: str) -> None:
        raise NotImplementedError

    def feed(self, text: str) -> int:
        i = 0
        while i < len(text) and not self.done:
            if self._step(text[i]):
                i += 1
        return i

    def _step(self, c: str) -> bool:
        """Reads ``c``; False when it was not consumed (read it again, in the new state)."""
        state = self.state
        if state == "string":
            return self._string(c)
        if state == "number":
            return self._number(c)
        if state == "literal":
            return self._literal(c)
        if c in _WHITESPACE:
            return True
        depth = len(self.stack)
        if state == "value" or (state == "first" and c != "]"):
            return self._value(c)
        if state in ("first", "after") and c == self.stack[-1]:
            self.stack.pop()
            self.emit(c, depth - 1, "value")
            self._ended()
        elif state == "after" and c == ",":
            self.emit(", ", depth, "sep")
            self.state = "key" if self.stack[-1] == "}" else "value"
        elif state in ("key", "first_key") and c == '"':
            self.emit('"', depth, "key")
            self.state, self.in_key = "string", True
        elif state == "first_key" and c == "}":
            self.stack.pop()
            self.emit(c, depth - 1, "value")
            self._ended()
        elif state == "colon" and c == ":":
            self.emit(": ", depth, "sep")
            self.state = "value"
        else:
            raise JsonError(f"unexpected {c!r} (reading {state})")
        return True

    def _value(self, c: str) -> bool:
        if c in _CLOSER:
            self.emit(c, len(self.stack), "value")
            self.stack.append(_CLOSER[c])
            self.state = "first_key" if c == "{" else "first"
        elif c == '"':
            self.emit('"', len(self.stack), "value")
            self.state = "string"
        elif c in _NUMBER_CHARS:
            self.state, self.token = "number", c
        elif c.isalpha():
            self.state, self.token = "literal", c
        else:
            raise JsonError(f"unexpected {c!r} where a value begins")
        return True

    def _ended(self) -> None:
        """A value ended (the stack is as it was around it)."""
        self.state = "after"
        if not self.stack:
            self.done = True
        self.value_ended(len(self.stack))

    def value_ended(self, depth: int) -> None:
        """Called after each value (hook)."""

    def cut_short(self) -> None:
        """The text ended here: emit what is still held as it was written (a number, a
        literal or an escape being read, a high surrogate waiting for its low half), so a
        cut answer keeps everything the model generated."""
        part = "key" if self.in_key else "value"
        if self.high is not None:
            self.emit(f"\\u{self.high:04x}", len(self.stack), part)
            self.high = None
        if self.token:
            self.emit(self.token, len(self.stack), part)
            self.token = ""

    def _number(self, c: str) -> bool:
        if c in _NUMBER_CHARS:
            self.token += c
            return True
        try:  # json's own reading and spelling (1E2 is 100.0)
            spelled = json.dumps(json.loads(self.token))
        except ValueError:
            raise JsonError(f"bad number {self.token!r}") from None
        self.token = ""
        self.emit(spelled, len(self.stack), "value")
        self._ended()
        return False

    def _literal(self, c: str) -> bool:
        self.token += c
        if self.token in _LITERALS:
            self.emit(self.token, len(self.stack), "value")
            self.token = ""
            self._ended()
        elif not any(lit.startswith(self.token) for lit in _LITERALS):
            raise JsonError(f"bad literal {self.token!r}")
        return True

    def _string(self, c: str) -> bool:
        token = self.token
        if token == "\\":
            self.token = ""
            if c != "u" and self.high is not None:  # a lone high surrogate: json keeps it
                self._char(chr(self.high))
                self.high = None
            if c == "u":
                self.token = "\\u"
            elif c in _UNESCAPE:
                self._char(_UNESCAPE[c])
            else:
                raise JsonError(f"bad escape \\{c}")
            return True
        if token:  # \\u and some hex digits
            if c not in "0123456789abcdefABCDEF":
                raise JsonError(f"bad escape {token + c!r}")
            self.token += c
            if len(self.token) == 6:
                code, self.token = int(self.token[2:], 16), ""
                self._code_point(code)
            return True
        if self.high is not None and c != "\\":  # a lone high surrogate: json keeps it
            self._char(chr(self.high))
            self.high = None
        if c == "\\":
            self.token = "\\"
        elif c == '"':
            part = "key" if self.in_key else "value"
            self.emit('"', len(self.stack), part)
            if self.in_key:
                self.in_key = False
                self.state = "colon"
                self.key_ended()
            else:
                self._ended()
        elif c < " ":
            raise JsonError("a control character in a string")
        else:
            self._char(c)
        return True

    def key_ended(self) -> None:
        """Called after each key (hook)."""

    def _code_point(self, code: int) -> None:
        if self.high is not None:
            high, self.high = self.high, None
            if 0xDC00 <= code <= 0xDFFF:
                self._char(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
                return
            self._char(chr(high))
        if 0xD800 <= code <= 0xDBFF:
            self.high = code
        else:
            self._char(chr(code))

    def _char(self, char: str) -> None:
        self.emit(_spelled(char), len(self.stack), "key" if self.in_key else "value")
        self.string_char(char)

    def string_char(self, char: str) -> None:
        """Called with each decoded character of a string (hook)."""


class CallJson(CanonicalJson):
    """One call's JSON object, ``{"name": ..., "arguments": {...}}`` ("parameters" too):
    its name, and the canonical text of its arguments in ``arguments`` as it arrives."""

    ARGS_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        super().__init__()
        self.member: str | None = None  # the outer key whose value is being read
        self.key = ""
        self.name = ""
        self.name_done = False
        self.arguments: list[str] = []

    def emit(self, text: str, depth: int, part: str) -> None:
        # The outer object's own braces, keys and separators are not the arguments.
        inside = depth >= 2 or (depth == 1 and part == "value")
        if inside and self.member in self.ARGS_KEYS:
            self.arguments.append(text)

    def string_char(self, char: str) -> None:
        if len(self.stack) == 1:
            if self.in_key:
                self.key += char
            elif self.member == "name":
                self.name += char

    def key_ended(self) -> None:
        if len(self.stack) == 1:
            self.member, self.key = self.key, ""

    def value_ended(self, depth: int) -> None:
        if depth == 1:
            self.name_done = self.name_done or self.member == "name"
            self.member = None


@dataclass
class CallsDelta:
    """What one text delta (or the end) adds: content, and pieces of calls."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add(
        self, index: int, arguments: str, id: str | None = None, name: str | None = None
    ) -> None:
        """A piece of call ``index``, joined to the previous one if it is of that call."""
        last = self.calls[-1] if self.calls else None
        if id is None and last is not None and last.index == index:
            self.calls[-1] = ToolCallDelta(index, last.arguments + arguments, last.id, last.name)
        elif id is not None or arguments:
            self.calls.append(ToolCallDelta(index, arguments, id, name))


class WholeCalls:
    """A format's whole-call parser, its complete calls as deltas (header and all the
    arguments in one). ``max_calls``: the calls kept (``parallel_tool_calls: false``
    keeps the first; a model without a grammar may still write more, which are
    dropped, as a model held to one call would not have written them)."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.num_calls = 0

    def feed(self, text: str) -> CallsDelta:
        return self._deltas(self.parser.feed(text))

    def finish(self) -> CallsDelta:
        return self._deltas(self.parser.finish())

    def _deltas(self, parse: ToolParse) -> CallsDelta:
        out = CallsDelta(parse.content)
        for call in parse.calls:
            if self.max_calls is not None and self.num_calls >= self.max_calls:
                continue
            out.add(self.num_calls, call.arguments, call.id, call.name)
            self.num_calls += 1
        return out


@dataclass(frozen=True)
class Envelope:
    """How a format wraps its calls (as its grammar writes them; whitespace may come
    between the parts)."""

    opening: tuple[str, ...]  # before the first call
    before: str  # before each call
    after: str  # after each call
    separator: str  # between two calls ("": the next one's ``before`` follows)
    closing: str  # after the last


ENVELOPES = {
    "hermes": Envelope((), "<tool_call>", "</tool_call>", "", ""),
    "llama3_json": Envelope((), "", "", ";", ""),
    "mistral": Envelope(("[TOOL_CALLS]", "["), "", "", ",", "]"),
}


class StreamedCalls:
    """Reads a grammar-forced output's calls as they are written (module docstring)."""

    def __init__(self, parser: str, tool_names: frozenset[str]) -> None:
        self.format = parser
        self.names = tool_names
        self.envelope = ENVELOPES[parser]
        self.expect: list[str] = []  # literals to read, then ``self.then``
        self.matched = 0  # characters of ``expect[0]`` read
        self.then = "call"
        self.state = "literal"
        self._literals([*self.envelope.opening, self.envelope.before], "call")
        self.call: CallJson | None = None
        self.num_calls = 0
        self.opening_call = True  # a call is starting whose header is not sent yet
        self.held = ""  # what was read since the last header, or the last call's end
        self.fallback: WholeCalls | None = None  # the output turned out not to be calls
        self.failed = False  # the calls broke off (never under a grammar): the rest is text

    def feed(self, text: str) -> CallsDelta:
        if self.fallback is not None:
            return self.fallback.feed(text)
        out = CallsDelta()
        i = 0
        try:
            while i < len(text) and not self.failed:
                self._read(text[i], out)
                i += 1
        except JsonError:
            if self.num_calls == 0:  # nothing sent yet: all of it is read as without a grammar
                self.fallback = WholeCalls(make_tool_parser(self.format, self.names))
                return self.fallback.feed(self.held + text[i:])
            self.failed = True
        if self.failed:
            out.content += text[i:]
        return out

    def finish(self) -> CallsDelta:
        if self.fallback is None and self.num_calls == 0:
            self.fallback = WholeCalls(make_tool_parser(self.format, self.names))
            start = self.fallback.feed(self.held)
            end = self.fallback.finish()
            return CallsDelta(start.content + end.content, start.calls + end.calls)
        if self.fallback is not None:
            return self.fallback.finish()
        # Cut short: a call whose name was not read yet is text; one whose name was sent
        # keeps the rest of what was written.
        if self.opening_call:
            return CallsDelta(self.held.lstrip())
        out = CallsDelta()
        if self.call is not None:
            self.call.cut_short()
            out.add(self.num_calls - 1, "".join(self.call.arguments))
            self.call.arguments.clear()
        return out

    def _literals(self, literals: list[str], then: str) -> None:
        self.expect, self.matched, self.then = [x for x in literals if x], 0, then
        self.state = "literal" if self.expect else then

    def _read(self, c: str, out: CallsDelta) -> None:
        if self.call is not None:
            self._read_call(c, out)
            return
        if self.state == "literal":
            literal = self.expect[0]
            if self.matched or c not in _WHITESPACE:
                if c != literal[self.matched]:
                    raise JsonError(f"expected {literal!r}")
                self.matched += 1
                if self.matched == len(literal):
                    self._literals(self.expect[1:], self.then)
            self.held += c
            return
        env = self.envelope
        if c in _WHITESPACE:
            pass
        elif self.state == "call":
            if c != "{":
                raise JsonError("expected a call's object")
            self.call = CallJson()
            self._read_call(c, out)
            return
        elif self.state == "next" and env.separator and c == env.separator:
            self.opening_call, self.held = True, ""
            self._literals([env.before], "call")
            return
        elif self.state == "next" and not env.separator and c == env.before[:1]:
            self.opening_call, self.held = True, ""
            self._literals([env.before[1:]], "call")
        elif self.state == "next" and c == env.closing[:1]:
            self.state = "end"
        else:
            raise JsonError(f"unexpected {c!r} after the calls")
        self.held += c

    def _read_call(self, c: str, out: CallsDelta) -> None:
        call = self.call
        assert call is not None
        call.feed(c)
        self.held += c
        if self.opening_call and call.name_done:
            if call.name not in self.names:
                raise JsonError(f"no tool is named {call.name!r}")
            out.add(self.num_calls, "", new_call_id(), call.name)
            self.opening_call = False
            self.num_calls += 1
            self.held = ""
        if not self.opening_call and call.arguments:
            out.add(self.num_calls - 1, "".join(call.arguments))
            call.arguments.clear()
        if call.done:
            if self.opening_call:
                raise JsonError("a call without a name")
            self.call = None
            self.held = ""
            self._literals([self.envelope.after], "next")
