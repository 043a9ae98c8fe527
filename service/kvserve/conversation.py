"""A conversation's size, in the shape Hugging Face chat templates take it (OpenAI's
messages, tools as OpenAI function tools).

One definition for the engine (which refuses a prompt too long to fit, and tokenizes a
long one off the event loop) and the gateway (whose token estimate is made from it); it
imports nothing, so the gateway does not load the engine to use it.
"""

from __future__ import annotations

import json
from typing import Any


def text_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    """Characters of a conversation's text: contents, tool calls and tool schemas."""
    chars = 0
    for m in messages:
        chars += len(str(m.get("content") or ""))
        for call in m.get("tool_calls") or ():
            chars += len(json.dumps(call, ensure_ascii=False))
    if tools:
        chars += len(json.dumps(tools, ensure_ascii=False))
    return chars
