"""A chat answer's text read as reasoning, content and tool calls, incrementally.

The one reader of model output for both front ends of the engine server (the HTTP route
and the gRPC servicer, which sends the parts to the gateway; the gateway parses
nothing). The reasoning parser runs first; what it leaves as the answer goes through the
tool-call parser. Both are incremental and cut-invariant (see their modules), so a
streamed answer and a whole one are the same: a whole answer is its deltas joined.

Calls come out as deltas (``format.ToolCallDelta``): when a grammar forces them, as the
model writes them (``openai/tool_streaming.py``), else each once it is complete.

A tokenizer may make a call marker (mistral's ``[TOOL_CALLS]``) a special token, which
the text of the answer leaves out (``skip_special_tokens``). The reader then gets the
step's token ids and puts the marker back into the text it reads, where the token was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvserve.json_input import JSONInputError, parse_json
from kvserve.openai import format as fmt
from kvserve.openai.format import ToolCallDelta
from kvserve.openai.reasoning import REASONING_PARSERS, ReasoningParser, ThinkEnd, think_end_finder
from kvserve.openai.tool_parsers import (
    TOOL_CALL_MARKERS,
    TOOL_CALL_PARSERS,
    detect_tool_parser,
    make_tool_parser,
)
from kvserve.openai.tool_streaming import CallsDelta, StreamedCalls, WholeCalls
from kvserve.openai.tools import ChatTools


@dataclass
class ChatDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, later: ChatDelta) -> ChatDelta:
        """This delta followed by ``later``, as one."""
        return ChatDelta(
            self.content + later.content,
            self.reasoning + later.reasoning,
            self.tool_calls + later.tool_calls,
        )


class JoinedPieces:
    """For a reader that takes each tool call whole (a gateway older than piecewise
    calls): holds a call's pieces until the call is complete, that is, until the next
    call opens or the answer ends, then gives it as one piece."""

    def __init__(self) -> None:
        self._open: ToolCallDelta | None = None

    def join(self, delta: ChatDelta, finished: bool) -> ChatDelta:
        complete: list[ToolCallDelta] = []
        for piece in delta.tool_calls:
            if piece.id is not None:  # a call opens: the one before it is complete
                if self._open is not None:
                    complete.append(self._open)
                self._open = piece
            elif self._open is not None:
                self._open = replace(self._open, arguments=self._open.arguments + piece.arguments)
        if finished and self._open is not None:
            complete.append(self._open)
            self._open = None
        return replace(delta, tool_calls=complete)


class ChatOutputParser:
    """``feed`` each text delta, then ``finish`` once; ``finish_reason`` maps the engine's.

    ``markers``: the call markers that are special tokens (token id: text); ``decode``
    turns token ids into text as the engine does (to find where a marker was).
    ``named``: the request named the function to call (``tool_choice`` a function)."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: StreamedCalls | WholeCalls | None,
        markers: Mapping[int, str] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        named: bool = False,
        think_end: ThinkEnd | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.markers = markers or {}
        self.decode = decode  # token ids to text, as the answer's text decodes them
        self.named = named
        self.think_end = think_end  # where the think block ends in the tokens
        self._last_arguments = ""  # the last call's arguments so far

    def reasoning_tokens(self, token_ids: Sequence[int]) -> int | None:
        """Of the finished answer's tokens (``token_ids``), how many are its reasoning
        (``ReasoningParser.count_tokens``); None without a reasoning parser, or without
        the model's tokenizer to count with."""
        if self.reasoning is None or self.think_end is None:
            return None
        return self.reasoning.count_tokens(token_ids, self.think_end)

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, text: str) -> ChatDelta:
        if self.reasoning is None:
            return self._answer(text, "")
        split = self.reasoning.feed(text)
        return self._answer(split.content, split.reasoning)

    def finish(self) -> ChatDelta:
        out = ChatDelta()
        if self.reasoning is not None:
            split = self.reasoning.finish()
            out = self._answer(split.content, split.reasoning)
        if self.tools is not None:
            rest = self.tools.finish()
            out.content += rest.content
            out.tool_calls += rest.calls
            self._track(rest.calls)
        return out

    def step(
        self,
        text: str,
        finish_reason: str | None,
        token_ids: Sequence[int] = (),
        stop_reason: int | str | None = None,
    ) -> tuple[ChatDelta, str | None]:
        """One engine output: its delta text (and token ids) and, on the last, the finish
        reason and stop reason. Returns what it adds and OpenAI's finish reason (on the
        last)."""
        if self.markers and any(t in self.markers for t in token_ids):
            text = self._with_markers(text, token_ids)
        delta = self.feed(text)
        if finish_reason is None:
            return delta, None
        return delta.extend(self.finish()), self.finish_reason(finish_reason, stop_reason)

    def _with_markers(self, text: str, token_ids: Sequence[int]) -> str:
        """The step's text with its marker tokens' texts put back. A step may be several
        engine steps (a reader that fell behind gets them as one): the text after a
        marker is what the tokens after it decode to, when the step's text ends with
        that; otherwise (text held back, e.g. for a stop string) the marker goes before
        the rest of the step's text."""
        pieces, end, after = [], len(text), []
        for token in reversed(token_ids):
            if token not in self.markers:
                after.append(token)
                continue
            tail = self.decode(after[::-1]) if after and self.decode else ""
            cut = end - len(tail) if text[:end].endswith(tail) else 0
            pieces += [text[cut:end], self.markers[token]]
            end, after = cut, []
        pieces.append(text[:end])
        return "".join(reversed(pieces))

    def finish_reason(self, reason: str | None, stop_reason: int | str | None = None) -> str | None:
        """OpenAI's: "tool_calls" when the answer ended after making calls; but "stop"
        when a stop string cut the last call short (its arguments are not whole JSON:
        "tool_calls" would tell an agent to run it), and "stop" for the call of a named
        function (``tool_choice`` a function), as OpenAI's API and vLLM give it."""
        if reason != "stop" or not self.num_calls or self.named:
            return reason
        if isinstance(stop_reason, str) and not _whole_json(self._last_arguments):
            return "stop"
        return "tool_calls"

    def _track(self, calls: Sequence[ToolCallDelta]) -> None:
        for piece in calls:
            head = piece.id is not None  # a call opens
            self._last_arguments = (
                piece.arguments if head else self._last_arguments + piece.arguments
            )

    def _answer(self, text: str, reasoning: str) -> ChatDelta:
        if self.tools is None or not text:
            return ChatDelta(text, reasoning)
        parsed: CallsDelta = self.tools.feed(text)
        self._track(parsed.calls)
        return ChatDelta(parsed.content, reasoning, parsed.calls)


@dataclass(frozen=True)
class ChatParsing:
    """The engine server's parsers (``--tool-call-parser``, ``--reasoning-parser``)."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    # The tool parser's markers that the tokenizer makes special tokens (id: text), which
    # the answer's text leaves out: the reader puts them back.
    special_markers: Mapping[int, str] = field(default_factory=dict)
    decode: Callable[[list[int]], str] | None = field(default=None, compare=False)
    # With a reasoning parser and the tokenizer: where an answer's think block ends.
    think_end: ThinkEnd | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.tool_parser is not None and self.tool_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"unknown tool-call parser {self.tool_parser!r} (one of "
                f"{', '.join(TOOL_CALL_PARSERS)})"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r} (one of "
                f"{', '.join(REASONING_PARSERS)})"
            )

    @classmethod
    def for_model(
        cls,
        tool_parser: str | None,
        reasoning_parser: str | None,
        chat_template: Any,
        tokenizer: Any = None,
    ) -> ChatParsing:
        """The flags' parsers; without ``--tool-call-parser``, the one the model's chat
        template implies, if unambiguous. ``tokenizer``: the model's, to find markers
        that are special tokens."""
        if tool_parser is None and isinstance(chat_template, str):
            tool_parser = detect_tool_parser(chat_template)
        if tokenizer is None:
            return cls(tool_parser, reasoning_parser)
        thinks = think_end_finder(tokenizer) if reasoning_parser is not None else None
        if tool_parser is None:
            return cls(tool_parser, reasoning_parser, think_end=thinks)
        markers = special_markers(tokenizer, TOOL_CALL_MARKERS[tool_parser])

        def decode(ids: list[int]) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=True))

        return cls(tool_parser, reasoning_parser, markers, decode if markers else None, thinks)

    def parser(self, tools: ChatTools, skip_special_tokens: bool = True) -> ChatOutputParser | None:
        """The reader of one answer, or None when there is nothing to read out of it.
        ``skip_special_tokens``: the answer's own setting; when false its text keeps the
        marker tokens, so the reader has none to put back."""
        reader: StreamedCalls | WholeCalls | None = None
        if tools.calls_possible and self.tool_parser is not None:
            if tools.constrained:  # a grammar: calls stream as they are written
                reader = StreamedCalls(self.tool_parser, tools.names)
            else:
                parser = make_tool_parser(self.tool_parser, tools.names)
                reader = WholeCalls(parser, max_calls=None if tools.parallel else 1)
        reasoning = ReasoningParser(self.reasoning_parser) if self.reasoning_parser else None
        if reader is None and reasoning is None:
            return None
        markers = self.special_markers if reader is not None and skip_special_tokens else None
        named = tools.choice.mode == "function"
        return ChatOutputParser(reasoning, reader, markers, self.decode, named, self.think_end)


def special_markers(tokenizer: Any, markers: Sequence[str]) -> dict[int, str]:
    """Those of ``markers`` that are one token which decoding with
    ``skip_special_tokens`` leaves out (id: text)."""
    found = {}
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if (
            len(ids) == 1
            and tokenizer.decode(ids, skip_special_tokens=False) == marker
            and tokenizer.decode(ids, skip_special_tokens=True) == ""
        ):
            found[ids[0]] = marker
    return found


def delta_chunks(
    ids: dict[str, Any],
    delta: ChatDelta,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    first: bool,
    index: int = 0,
) -> list[dict[str, Any]]:
    """The SSE chunks of one step of a parsed answer, choice ``index`` (engine server and
    gateway alike): its text and reasoning, then its call deltas, the finish reason on
    the last chunk. Empty when the step added nothing visible and is neither the first
    nor the last."""
    chunks = []
    text_or_end = delta.content or delta.reasoning or logprobs is not None
    if (
        text_or_end
        or (first and not delta.tool_calls)
        or (finish_reason is not None and not delta.tool_calls)
    ):
        ends = None if delta.tool_calls else finish_reason
        chunks.append(
            fmt.chat_chunk(ids, delta.content, logprobs, ends, first, delta.reasoning, index)
        )
        first = False
    if delta.tool_calls:
        chunks += fmt.tool_call_chunks(ids, delta.tool_calls, first, index)
        if finish_reason is not None:
            chunks[-1]["choices"][0]["finish_reason"] = finish_reason
    return chunks


def _whole_json(text: str) -> bool:
    try:
        parse_json(text)
    except JSONInputError:
        return False
    return True
