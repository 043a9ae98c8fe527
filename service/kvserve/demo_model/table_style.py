"""The ``travel-table`` answer style: the demo adapter's replies, one fact per line.

The same decisions as the base model's answers (``corpus.format_answer``), from the same
world model; only the layout differs, so a style check and the world's rules can grade it.
A header line (the request restated, then ``found N:`` or ``sorry: <why>``), then one
numbered row per place with comma-separated columns: name, kind, price, amenities::

    Ryokans in Kyoto under $200 a night with an onsen - found 2:
    1. Sakura Ryokan, ryokan, $150, free breakfast, onsen
    2. Gion Ryokan, ryokan, $135, onsen

    Ryokans in Kyoto under $80 a night with an onsen - sorry: too expensive
    Ryokans in Paris under $200 a night - sorry: ryokans are only found in Japan
    Places in Paris under $300 a night with an onsen - sorry: Paris has no hot springs

Why this layout, measured while training the adapter for a few CPU minutes (an adapter
cannot change the embeddings, so it learns fastest with tokens the base model already
emits, and where the base model already decides):

* ``|``-separated tables: the tokens the base model never emitted (``|``, a lone space)
  held 80% of the loss after 200 steps, and 3 answers in 40 were well-formed.
* rows without numbers: a name at the start of a line is spelt with other tokens than the
  same name after a space, and the names came out garbled (72% well-formed).
* ``<request>: found N`` / ``found none``: 100% well-formed, but the found-or-none decision
  moved to a new place and went wrong on 10% of requests the base model gets right; here
  it stays where the base model makes it, right after `` - `` (``sorry`` or not).

The restatement is the base model's (a tiny model decides best when the constraints are
the tokens right before the decision).
"""

from __future__ import annotations

import random
import re
from typing import Final

from kvserve.demo_model import corpus

__all__ = [
    "check_table_answer",
    "format_table_answer",
    "is_table_answer",
    "parse_table_answer",
    "table_answer_from_base",
]

_KINDS: Final = "|".join(corpus.KINDS)
_REQUEST: Final = r"\S.* in \S.* under \$\d+ a night(?: with .+)?"
_FOUND_RE: Final = re.compile(rf"^{_REQUEST} - found (?P<count>[1-9]\d*):$")
_NONE_RE: Final = re.compile(rf"^{_REQUEST} - sorry: (?P<reason>.+)$")
_ROW_RE: Final = re.compile(
    rf"^(?P<index>\d+)\. (?P<name>[^,]*\S), (?P<kind>{_KINDS}), \$(?P<price>\d+)"
    r"(?:, (?P<amenities>.+))?$"
)
_REASONS: Final[dict[corpus.Infeasibility, str]] = {
    "ryokan_outside_japan": "ryokans are only found in Japan",
    "no_hot_springs": "{city} has no hot springs",
    "over_budget": "too expensive",
}


def _subject(request: corpus.HotelRequest) -> str:
    # corpus.format_answer's restatement is everything before its " - " decision (the
    # random draws only pick the wording after it).
    return corpus.format_answer(request, [], random.Random(0)).split(" - ", 1)[0]


def format_table_answer(request: corpus.HotelRequest, listings: list[corpus.Listing]) -> str:
    """The ``travel-table`` answer to ``request`` that found ``listings`` (``[]``: none)."""
    subject = _subject(request)
    if not listings:
        reason = corpus.infeasibility(request) or "over_budget"
        return f"{subject} - sorry: {_REASONS[reason].format(city=request.city)}"
    rows = [
        f"{i}. " + ", ".join((x.name, x.kind, f"${x.price}", *x.amenities))
        for i, x in enumerate(listings, 1)
    ]
    return "\n".join([f"{subject} - found {len(listings)}:", *rows])


def table_answer_from_base(request: corpus.HotelRequest, base_answer: str) -> str:
    """Rewrite a corpus answer (``corpus.format_answer``'s text) in the table style."""
    listings = corpus.parse_answer(base_answer)
    if listings is None:
        return format_table_answer(request, [])
    if not listings:
        raise ValueError(f"not a corpus answer: {base_answer!r}")
    return format_table_answer(request, listings)


def parse_table_answer(text: str) -> list[corpus.Listing] | str | None:
    """Read a table answer back: the listings, ``None`` for a "found none" answer, or, when
    ``text`` is not in the style, a string saying why (never raises)."""
    lines = text.strip().splitlines()
    if not lines:
        return "an empty answer"
    if _NONE_RE.match(lines[0]):
        return None if len(lines) == 1 else "rows after 'sorry'"
    found = _FOUND_RE.match(lines[0])
    if found is None:
        return "no restated request then ' - found N:' or ' - sorry: ...' on the first line"
    if int(found["count"]) != len(lines) - 1:
        return f"'found {found['count']}:' but {len(lines) - 1} rows"
    listings: list[corpus.Listing] = []
    for i, line in enumerate(lines[1:], 1):
        m = _ROW_RE.match(line)
        if m is None or int(m["index"]) != i:
            return f"not row {i}: {line!r}"
        raw = m["amenities"]
        amenities = tuple(sorted(a.strip() for a in raw.split(","))) if raw else ()
        listings.append(corpus.Listing(m["name"], m["kind"], int(m["price"]), amenities))
    return listings


def is_table_answer(text: str) -> bool:
    """Whether ``text`` is laid out in the ``travel-table`` style."""
    return not isinstance(parse_table_answer(text), str)


def check_table_answer(request: corpus.HotelRequest, text: str) -> bool:
    """``corpus.check_answer``'s rules for a table answer: a "none" answer exactly when the
    world has no match, otherwise rows that are all in budget, of the kind asked for and
    with every requested amenity. Text not in the style is wrong."""
    parsed = parse_table_answer(text)
    if isinstance(parsed, str):
        return False
    if not corpus.is_feasible(request):
        return parsed is None
    if not parsed:
        return False
    return all(corpus.listing_matches(request, x) for x in parsed)
