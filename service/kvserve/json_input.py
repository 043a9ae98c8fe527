"""Reading JSON that someone else wrote: checkpoint files, adapter configs, list files,
and JSON text inside requests (tool-call arguments, schemas, template arguments).

``json.loads`` fails in four ways on such input (bytes that are not UTF-8, text that is
not JSON, JSON nested deeper than the parser's recursion limit, and a value of the wrong
kind) and reading a file in one more. The third raises ``RecursionError``, which is not
a ``ValueError``: a caller that caught only ``ValueError`` answered a few kilobytes of
``[`` with a traceback or a 500. Here each becomes one :class:`JSONInputError` whose
message says which, without the input's name: callers put the name they show users in
front and raise their own error type. Standard library only: the model-pull and
adapter-sync commands import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# What the parser's RecursionError means: no file this project reads nests anywhere near
# that deep (the limit is about a thousand levels).
_TOO_DEEP = "JSON nested too deeply to read"


class JSONInputError(ValueError):
    """Input that is not the JSON asked for; ``missing`` when there is no file to read."""

    def __init__(self, problem: str, *, missing: bool = False) -> None:
        super().__init__(problem)
        self.missing = missing


def parse_json(data: str | bytes) -> Any:
    """The JSON value in ``data`` (bytes must be UTF-8)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise JSONInputError(f"not UTF-8: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise JSONInputError(f"not valid JSON: {e}") from None
    except RecursionError:
        raise JSONInputError(_TOO_DEEP) from None


def parse_json_object(data: str | bytes) -> dict[str, Any]:
    """The JSON object in ``data``; any other JSON value is refused by its type."""
    value = parse_json(data)
    if not isinstance(value, dict):
        raise JSONInputError(f"expected a JSON object, got {type(value).__name__}")
    return value


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file ``path``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise JSONInputError("missing", missing=True) from None
    except OSError as e:
        raise JSONInputError(f"unreadable: {e.strerror or e}") from None
    return parse_json_object(data)
