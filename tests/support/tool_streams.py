"""Tool calls out of a streamed chat answer, read as an OpenAI SDK user reads them, with
the checks of OpenAI's shape: a call's first delta carries index, id, type and name (no
arguments yet); later deltas only append to its arguments; calls open in index order."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamedCall:
    id: str
    name: str
    pieces: list[str] = field(default_factory=list)  # the arguments as they arrived

    @property
    def arguments(self) -> str:
        return "".join(self.pieces)


def streamed_calls(chunks: Iterable[Any]) -> list[StreamedCall]:
    """The calls of an SDK stream (``ChatCompletionChunk`` objects), checked."""
    calls: dict[int, StreamedCall] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or ():
            assert d.function is not None
            if d.index not in calls:
                assert d.index == len(calls)  # one call after the other
                assert d.id and d.id.startswith("call_") and d.type == "function"
                assert d.function.name and d.function.arguments == ""
                calls[d.index] = StreamedCall(d.id, d.function.name)
            else:
                assert d.id is None and d.function.name is None
                calls[d.index].pieces.append(d.function.arguments or "")
    return [calls[i] for i in sorted(calls)]


def streamed_in_pieces(client: Any, request: dict[str, Any]) -> tuple[list[StreamedCall], str]:
    """A forced answer's calls streamed (checked: each call's arguments arrive in more
    than one piece, and put together they are the whole answer's calls), and the whole
    answer's finish reason."""
    calls = streamed_calls(client.chat.completions.create(stream=True, **request))
    assert calls
    for call in calls:
        assert len([p for p in call.pieces if p]) > 1, call  # not in one piece
    whole = client.chat.completions.create(**request).choices[0]
    assert [(c.name, c.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []
    ]
    return calls, whole.finish_reason
