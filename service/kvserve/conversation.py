"""A conversation's size, in the shape Hugging Face chat templates take it (OpenAI's
messages, tools as OpenAI function tools), and how its rendered prompt ends.

One definition for the engine (which refuses a prompt too long to fit, and tokenizes a
long one off the event loop) and the gateway (whose token estimate is made from it); it
imports nothing, so the gateway does not load the engine to use it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

# How a rendered conversation ends (vLLM's add_generation_prompt and
# continue_final_message): with the assistant's turn opened for a new answer (the
# default), with nothing added, or with the final message left open for the model to go on.
ChatEnding = Literal["generation_prompt", "none", "continue_final_message"]


def chat_ending(add_generation_prompt: bool, continue_final_message: bool) -> ChatEnding:
    """vLLM's two fields as one ending; ValueError when both are set."""
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message continues the final message, add_generation_prompt "
            "opens a new assistant turn: set add_generation_prompt to false with it"
        )
    if continue_final_message:
        return "continue_final_message"
    return "generation_prompt" if add_generation_prompt else "none"


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
