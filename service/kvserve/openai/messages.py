"""A chat request's messages as Hugging Face chat templates take them.

Templates (Qwen2.5, Qwen3, Hermes, Llama 3.1, Mistral) read ``content`` as one string and
an assistant's ``tool_calls[].function.arguments`` as a mapping: Qwen2.5's and Hermes'
render it with ``tojson``, so a JSON string would come out quoted twice; Qwen3's accepts
either. So text parts are joined into one string, and arguments are parsed here (a
string that is not a JSON object is a 400 naming it).
"""

from __future__ import annotations

from typing import Any

from kvserve.json_input import JSONInputError, parse_json
from kvserve.openai.errors import OpenAIError
from kvserve.openai.protocol import ChatMessage, ContentPart

Message = dict[str, Any]

# Part types of OpenAI's API that carry something other than text.
NON_TEXT_PARTS = ("image_url", "input_audio", "file", "image", "audio")


def template_messages(messages: list[ChatMessage]) -> list[Message]:
    """The conversation for ``apply_chat_template``; 400 naming the message (or part) that
    this text-only model cannot take."""
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: ChatMessage) -> Message:
    where = f"messages[{i}]"
    out: Message = {"role": m.role}
    if m.content is None:
        if m.role == "assistant" and m.refusal is not None:  # a refusal sent back
            out["content"] = m.refusal
        elif not (m.role == "assistant" and m.tool_calls):
            raise OpenAIError(
                400,
                f"{where}.content is null: only an assistant message with tool_calls or a "
                "refusal may have no content",
                param=f"{where}.content",
            )
        else:
            out["content"] = ""
    elif isinstance(m.content, str):
        out["content"] = m.content
    else:
        out["content"] = _text_of_parts(m.content, f"{where}.content", m.role)
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        if m.role != "assistant":
            raise OpenAIError(
                400,
                f"{where}: only assistant messages carry tool_calls",
                param=f"{where}.tool_calls",
            )
        out["tool_calls"] = [
            _tool_call(c.id, c.function.name, c.function.arguments) for c in m.tool_calls
        ]
    if m.role == "tool":
        if not m.tool_call_id:
            raise OpenAIError(
                400,
                f"{where}: a tool message needs the tool_call_id of the call it answers",
                param=f"{where}.tool_call_id",
            )
        out["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None and m.role == "assistant":
        out["reasoning_content"] = reasoning  # Qwen3's template reads it
    return out


def _text_of_parts(parts: list[ContentPart], where: str, role: str) -> str:
    """A message's parts as its text: text parts, and an assistant's refusal parts (what
    it said), joined by newlines."""
    if not parts:  # as OpenAI's API refuses it
        raise OpenAIError(
            400, f"{where} is an empty array: send a string or at least one part", param=where
        )
    texts = []
    for k, part in enumerate(parts):
        param = f"{where}[{k}]"
        if part.type == "text":
            if part.text is None:
                raise OpenAIError(400, f"{param}: a text part needs its text", param=param)
            texts.append(part.text)
        elif part.type == "refusal" and role == "assistant":
            if part.refusal is None:
                raise OpenAIError(400, f"{param}: a refusal part needs its refusal", param=param)
            texts.append(part.refusal)
        elif part.type in NON_TEXT_PARTS:
            raise OpenAIError(
                400,
                f"{param} is an {part.type!r} part: this model takes text only",
                param=param,
            )
        else:
            raise OpenAIError(400, f"{param}: unknown content part type {part.type!r}", param=param)
    return "\n".join(texts)


def _tool_call(call_id: str, name: str, arguments: str) -> Message:
    function = {"name": name, "arguments": tool_call_arguments(arguments)}
    return {"id": call_id, "type": "function", "function": function}


def tool_call_arguments(text: str) -> dict[str, Any] | str:
    """A replayed call's arguments for the chat template: the object they spell (chat
    templates write it back as JSON), or, when they are not a JSON object, the text as
    the model wrote it. A call cut short by max_tokens has incomplete arguments, and a
    conversation that holds one must still go on (agent frameworks send it back with an
    error as the tool's result); OpenAI's API does not refuse it either."""
    if not text.strip():
        return {}
    try:
        value = parse_json(text)
    except JSONInputError:
        return text
    return value if isinstance(value, dict) else text
