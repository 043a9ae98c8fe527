"""The demo model's ``search_hotels`` calls: read one out of a completion, strictly, and grade it.

A call is what the chat template renders for an assistant ``tool_calls`` turn (Hermes
style)::

    <tool_call>
    {"name": "search_hotels", "arguments": {"city": "Kyoto", "max_price": 200, ...}}
    </tool_call>

:func:`parse_tool_call` accepts exactly that -- one call, surrounding whitespace only -- so
``kvserve eval-demo`` counts a call as right only when a strict client could use it.
(Servers parse completions with ``kvserve.openai.tool_parsers``, which also takes text
around calls; ``kvserve chat --tools`` uses that one.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvserve.demo_model.corpus import CITY_BY_NAME, HotelRequest
from kvserve.demo_model.tokenizer import TOOL_CALL_END, TOOL_CALL_START

__all__ = ["ToolCall", "call_satisfies", "parse_tool_call"]

_CALL_RE: Final = re.compile(
    rf"\s*{re.escape(TOOL_CALL_START)}\s*(?P<json>\{{.*\}})\s*{re.escape(TOOL_CALL_END)}\s*",
    re.DOTALL,
)
_ARGUMENT_NAMES: Final = frozenset({"city", "max_price", "kind", "amenities"})


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_call(text: str) -> ToolCall | None:
    """The one call that makes up ``text``, or None: any other text, a second call, JSON
    that does not parse, or a call without a string ``name`` and an object ``arguments``."""
    m = _CALL_RE.fullmatch(text)
    if m is None:
        return None
    try:
        obj = json.loads(m.group("json"))
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
        return None
    name, arguments = obj["name"], obj["arguments"]
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return ToolCall(name, arguments)


def call_satisfies(request: HotelRequest, call: ToolCall) -> bool:
    """Whether ``call`` is ``search_hotels`` with arguments that ask for exactly ``request``.

    The city may be its canonical name or one of its aliases; ``max_price`` is the budget
    (an integer); ``kind`` is the requested kind, absent or null for any kind; ``amenities``
    equal the requested ones as a set (absent means none). No other argument is allowed.
    """
    args: Mapping[str, Any] = call.arguments
    if call.name != "search_hotels" or not set(args) <= _ARGUMENT_NAMES:
        return False
    city = CITY_BY_NAME[request.city]
    if args.get("city") not in (city.name, *city.aliases):
        return False
    price = args.get("max_price")
    if isinstance(price, bool) or price != request.max_price or not isinstance(price, int):
        return False
    if args.get("kind") != request.kind:
        return False
    amenities = args.get("amenities", [])
    if not isinstance(amenities, list) or not all(isinstance(a, str) for a in amenities):
        return False
    return len(amenities) == len(set(amenities)) and set(amenities) == set(request.amenities)
