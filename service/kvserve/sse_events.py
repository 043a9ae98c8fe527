"""The events of an OpenAI streaming response, as a client reads them.

``/v1/completions`` and ``/v1/chat/completions`` stream server-sent events (the engine
server and the gateway alike): ``data: {json}`` lines, blank separators, comments, and
``data: [DONE]`` at the end. Three clients read them: ``kvserve chat``, the Locust load
tests and the benchmarks. Each keeps its own transport, because their needs differ: chat
blocks on an httpx stream it can close to abort, Locust's users run on gevent with its
``requests``-style session, and the benchmarks read a raw asyncio socket, because their
client shares the CPUs with the servers they time. What an event means is the same for
all three, and is read here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"  # the payload of the stream's last event


def event_data(line: str | bytes) -> str | None:
    """The payload of an SSE ``data:`` line; None for any other line (blank separators,
    comments such as ``: ping``, other fields)."""
    if isinstance(line, bytes):
        line = line.decode()
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


@dataclass(frozen=True)
class StreamEvent:
    """What one event says."""

    text: str = ""  # the visible text of its choices: a completion's text, a chat delta's
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None  # the message of an error event


def parse_event(data: str | bytes) -> StreamEvent:
    """Read one event's payload (not ``[DONE]``). Raises ValueError when it is not JSON."""
    payload = json.loads(data)
    if not isinstance(payload, dict):
        return StreamEvent()
    if "error" in payload:
        return StreamEvent(error=error_message(payload))
    text, finish_reason = "", None
    for choice in payload.get("choices") or []:
        if isinstance(choice, dict):
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish_reason = choice.get("finish_reason") or finish_reason
    return StreamEvent(text, finish_reason, payload.get("usage") or None)


def error_message(payload: Any) -> str:
    """The message of an OpenAI error (``{"error": {"message": ...}}``, in a response
    body or an event), or of a bare error string; else the payload, cut short."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str):
        return err
    return json.dumps(payload)[:200]
