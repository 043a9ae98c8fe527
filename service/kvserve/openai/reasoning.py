"""A reasoning model's ``<think>…</think>`` block split from its answer, incrementally.

``--reasoning-parser`` names, as vLLM's:

* ``qwen3``: the output reasons only if it begins with ``<think>`` (after whitespace);
  otherwise all of it is the answer (Qwen3 with thinking switched off, or a model that
  answers at once). Reasoning runs to ``</think>``; an output that ends inside the block
  (cut by ``max_tokens``) is all reasoning.
* ``deepseek_r1``: the chat template already opened the block (DeepSeek-R1 and QwQ
  templates end the prompt with ``<think>``), so the output is reasoning from its first
  character to ``</think>``, whether or not it repeats ``<think>``; an output without
  ``</think>`` is all reasoning.

Invariants: each character of the output goes to exactly one side (less the markers);
the split is the same however the text is cut into deltas, a marker cut across deltas
included (text that may be the start of a marker is held back until it is known).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.openai.tool_parsers import held_prefix

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"


def opens_in_prompt(name: str) -> bool:
    """Whether the parser's models begin their output inside the think block (their chat
    template opened it), rather than maybe opening one."""
    return name == "deepseek_r1"


@dataclass
class ReasoningSplit:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """``feed`` each text delta, then ``finish`` once."""

    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r} (one of {REASONING_PARSERS})")
        # deepseek_r1 starts inside the block; qwen3 decides from the output's start.
        self.implicit_start = opens_in_prompt(name)
        self.state = "start"  # start → reasoning → content
        self.buffer = ""

    def feed(self, text: str) -> ReasoningSplit:
        self.buffer += text
        out = ReasoningSplit()
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(THINK_START):
                self.buffer = head[len(THINK_START) :]
                self.state = "reasoning"
            elif not head or THINK_START.startswith(head):
                return out  # undecided
            elif self.implicit_start:
                self.state = "reasoning"
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.buffer.find(THINK_END)
            if end < 0:
                keep = held_prefix(self.buffer, THINK_END)
                out.reasoning = self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(out.reasoning) :]
                return out
            out.reasoning = self.buffer[:end]
            self.buffer = self.buffer[end + len(THINK_END) :]
            self.state = "content"
        out.content, self.buffer = self.buffer, ""
        return out

    def finish(self) -> ReasoningSplit:
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning" or (self.state == "start" and self.implicit_start):
            return ReasoningSplit(reasoning=rest)
        return ReasoningSplit(content=rest)
