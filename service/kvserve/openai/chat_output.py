"""A chat answer's text read as reasoning, content and tool calls, incrementally.

The one reader of model output for both front ends of the engine server (the HTTP route
and the gRPC servicer, which sends the parts to the gateway; the gateway parses
nothing). The reasoning parser runs first; what it leaves as the answer goes through the
tool-call parser. Both are incremental and cut-invariant (see their modules), so a
streamed answer and a whole one are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.openai import format as fmt
from kvserve.openai.format import ToolCallValue
from kvserve.openai.reasoning import REASONING_PARSERS, ReasoningParser
from kvserve.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    ParsedToolCall,
    ToolCallParser,
    detect_tool_parser,
    make_tool_parser,
)
from kvserve.openai.tools import ChatTools


@dataclass
class ChatDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallValue] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, later: ChatDelta) -> ChatDelta:
        """This delta followed by ``later``, as one."""
        return ChatDelta(
            self.content + later.content,
            self.reasoning + later.reasoning,
            self.tool_calls + later.tool_calls,
        )


class ChatOutputParser:
    """``feed`` each text delta, then ``finish`` once; ``finish_reason`` maps the engine's."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.num_calls = 0

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
            out.tool_calls += self._indexed(rest.calls)
        return out

    def step(self, text: str, finish_reason: str | None) -> tuple[ChatDelta, str | None]:
        """One engine output: its delta text and, on the last, the finish reason. Returns
        what it adds and OpenAI's finish reason (on the last)."""
        delta = self.feed(text)
        if finish_reason is None:
            return delta, None
        return delta.extend(self.finish()), self.finish_reason(finish_reason)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the answer ended by itself after making calls."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason

    def _answer(self, text: str, reasoning: str) -> ChatDelta:
        if self.tools is None or not text:
            return ChatDelta(text, reasoning)
        parsed = self.tools.feed(text)
        return ChatDelta(parsed.content, reasoning, self._indexed(parsed.calls))

    def _indexed(self, calls: list[ParsedToolCall]) -> list[ToolCallValue]:
        out = []
        for call in calls:
            out.append(ToolCallValue(self.num_calls, call.id, call.name, call.arguments))
            self.num_calls += 1
        return out


@dataclass(frozen=True)
class ChatParsing:
    """The engine server's parsers (``--tool-call-parser``, ``--reasoning-parser``)."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None

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
        cls, tool_parser: str | None, reasoning_parser: str | None, chat_template: Any
    ) -> ChatParsing:
        """The flags' parsers; without ``--tool-call-parser``, the one the model's chat
        template implies, if unambiguous."""
        if tool_parser is None and isinstance(chat_template, str):
            tool_parser = detect_tool_parser(chat_template)
        return cls(tool_parser, reasoning_parser)

    def parser(self, tools: ChatTools) -> ChatOutputParser | None:
        """The reader of one answer, or None when there is nothing to read out of it."""
        tool_parser = None
        if tools.calls_possible and self.tool_parser is not None:
            tool_parser = make_tool_parser(self.tool_parser, tools.names)
        reasoning = ReasoningParser(self.reasoning_parser) if self.reasoning_parser else None
        if tool_parser is None and reasoning is None:
            return None
        return ChatOutputParser(reasoning, tool_parser)


def delta_chunks(
    ids: dict[str, Any],
    delta: ChatDelta,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    first: bool,
) -> list[dict[str, Any]]:
    """The SSE chunks of one step of a parsed answer (engine server and gateway alike):
    its text and reasoning, then its complete calls, the finish reason on the last chunk.
    Empty when the step added nothing visible and is neither the first nor the last."""
    chunks = []
    text_or_end = delta.content or delta.reasoning or logprobs is not None
    if (
        text_or_end
        or (first and not delta.tool_calls)
        or (finish_reason is not None and not delta.tool_calls)
    ):
        ends = None if delta.tool_calls else finish_reason
        chunks.append(fmt.chat_chunk(ids, delta.content, logprobs, ends, first, delta.reasoning))
        first = False
    if delta.tool_calls:
        chunks += fmt.tool_call_chunks(ids, delta.tool_calls, first)
        if finish_reason is not None:
            chunks[-1]["choices"][0]["finish_reason"] = finish_reason
    return chunks
