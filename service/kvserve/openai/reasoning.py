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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
        self.reasoned = False  # the output had a think block (open or closed)

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
            self.reasoned = self.state == "reasoning"
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
            self.reasoned = True
            return ReasoningSplit(reasoning=rest)
        return ReasoningSplit(content=rest)

    def count_tokens(self, token_ids: Sequence[int], ends_at: ThinkEnd) -> int:
        """How many of the finished output's tokens (``token_ids``, all of them) are its
        reasoning, the think block's markers included: none without a block, all of them
        when it never closed, else those up to the one that completes THINK_END."""
        if not self.reasoned:
            return 0
        closed = self.state == "content"  # (reached only through THINK_END, once it reasoned)
        return ends_at(token_ids) if closed else len(token_ids)


# Of an output's token ids: how many lead up to, and include, the one that completes
# THINK_END (the output holds it).
ThinkEnd = Callable[[Sequence[int]], int]


def think_end_finder(tokenizer: Any) -> ThinkEnd:
    """``ThinkEnd`` for ``tokenizer``'s outputs: found by its id where THINK_END is one
    token (an added token, as in Qwen3's and DeepSeek-R1's vocabularies), else by the
    shortest prefix whose text holds it (log₂ n decodes, once per finished answer)."""
    ids = tokenizer.encode(THINK_END, add_special_tokens=False)
    if len(ids) == 1:
        (end,) = ids
        return lambda tokens: next((i + 1 for i, t in enumerate(tokens) if t == end), len(tokens))

    def shortest_prefix(tokens: Sequence[int]) -> int:
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if THINK_END in tokenizer.decode(list(tokens[:mid]), skip_special_tokens=False):
                hi = mid
            else:
                lo = mid + 1
        return hi

    return shortest_prefix
