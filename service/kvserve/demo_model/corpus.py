"""Seeded, reproducible chat corpus about hotel search, and the checker for its answers.

The corpus trains a tiny demo model (a few million parameters, minutes of CPU time), so the
grammar is deliberately regular: users ask for a place to stay in one city, under a budget, with
0-3 amenities, in many phrasings; the assistant answers in one of a few fixed, regex-parseable
formats. A small world model decides what is possible:

* :data:`CITIES` -- each city has a country, a hot-springs flag, a price level and, for some,
  alternative names (``京都``, ``Lisboa``, ``Wien`` ...) that users sometimes type. The assistant
  always answers with the canonical English name.
* Ryokans exist only in Japan; an onsen only in hot-spring cities.
* Every kind has a price floor (:func:`price_floor`), higher with an onsen and the same in
  every city, so a budget can be too low. Budgets come from :data:`PRICE_CAPS`. A city's
  price level only spreads its listings' prices above the floor.

Listings are invented on the fly with compositional names ("Sakura Ryokan", "Alfama
Guesthouse"), so there is no catalogue to memorise: the model has to learn the rules.

Answer formats (the only ones the assistant uses): the request restated, then the decision::

    Ryokans in Kyoto under $200 a night with an onsen - I found 2:
    1. Sakura Ryokan (ryokan) - $150 a night - free breakfast, onsen
    2. Gion Ryokan (ryokan) - $135 a night - onsen

    Ryokans in Kyoto under $80 a night with an onsen - sorry, I found none. Would you like to
    raise your budget?

    Places in Paris under $300 a night with an onsen - sorry, Paris has no hot springs, so no
    place there has an onsen.

    Ryokans in Paris under $200 a night - sorry, ryokans are only found in Japan, so there are
    none in Paris. Would a hotel do?

(each answer is a single line for the sorry forms). After a ``search_hotels`` result the
answer copies the result's lines instead (:func:`format_answer_from_result`)::

    I found 3 ryokans:
    1. Gion Ryokan (ryokan) - $135 a night
    2. Sakura Ryokan (ryokan) - $150 a night
    3. Kamo Ryokan (ryokan) - $185 a night
    All of them have an onsen.

:func:`parse_answer` reads them all back and
:func:`check_answer` grades any text -- e.g. a model's completion -- against a request.

Tool use (issue 19): with ``tool_share`` > 0, :func:`generate_corpus` also yields
conversations that offer :data:`SEARCH_HOTELS_TOOL`: the assistant calls it with
:func:`tool_arguments` of the request, the ``tool`` message holds :func:`search_result`'s
text (three places, or why there are none), and the answer copies the result's lines
(:func:`format_answer_from_result`) or says "sorry" as above. :func:`search_hotels` is the
tool itself, over the same world model (``kvserve chat --tools`` runs it).

Randomness comes only from the ``random.Random`` passed in (or seeded here): training
conversations (:func:`generate_corpus`) and evaluation prompts (:func:`sample_requests`,
:func:`sample_eval_prompts`) use different seed streams, ``"kvserve-demo-train:<seed>"`` and
``"kvserve-demo-eval:<seed>"``, so the same integer seed never gives the same draws for both.
The request space is small (cities x kinds x budgets x amenity sets), so an evaluation request
usually also occurs in training; what is held out is the phrasing draw and the listings.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

__all__ = [
    "AMENITIES",
    "CITIES",
    "CITY_BY_NAME",
    "KINDS",
    "PRICE_CAPS",
    "SEARCH_HOTELS_TOOL",
    "SYSTEM_PROMPTS",
    "TOOL_SHARE",
    "City",
    "Conversation",
    "EvalPrompt",
    "HotelRequest",
    "Infeasibility",
    "Listing",
    "check_answer",
    "eval_rng",
    "feasible_listings",
    "format_answer",
    "generate_conversation",
    "generate_corpus",
    "generate_tool_conversation",
    "infeasibility",
    "is_feasible",
    "listing_line",
    "listing_matches",
    "min_price",
    "parse_answer",
    "parse_listing_line",
    "price_floor",
    "result_listings",
    "sample_eval_prompts",
    "sample_request",
    "sample_requests",
    "sample_tool_eval_prompts",
    "search_hotels",
    "search_result",
    "tool_arguments",
    "tool_eval_rng",
    "train_rng",
    "user_message",
]

# --------------------------------------------------------------------------------------------
# World model
# --------------------------------------------------------------------------------------------

KINDS: Final[tuple[str, ...]] = ("hotel", "ryokan", "hostel", "guesthouse")
_KIND_PLURAL: Final[dict[str, str]] = {
    "hotel": "hotels",
    "ryokan": "ryokans",
    "hostel": "hostels",
    "guesthouse": "guesthouses",
}
#: Price floor in USD of each kind in a city with price level 100.
_KIND_BASE_PRICE: Final[dict[str, int]] = {
    "hostel": 30,
    "guesthouse": 55,
    "hotel": 85,
    "ryokan": 100,
}
#: Extra USD on the floor of a place with an onsen.
ONSEN_SURCHARGE: Final[int] = 40

#: Canonical amenity names; requests and listings keep them sorted alphabetically.
AMENITIES: Final[tuple[str, ...]] = (
    "airport shuttle",
    "free breakfast",
    "free wifi",
    "gym",
    "onsen",
    "parking",
    "pets allowed",
    "wheelchair access",
)
_AMENITY_SET: Final[frozenset[str]] = frozenset(AMENITIES)

#: Budgets (USD per night) that users ask for.
PRICE_CAPS: Final[tuple[int, ...]] = (50, 80, 100, 120, 150, 200, 250, 300, 400)


@dataclass(frozen=True)
class City:
    name: str  # canonical English name, the one the assistant uses
    country: str
    hot_springs: bool
    price_level: int  # percent: how far above the floor a city's listings are priced
    aliases: tuple[str, ...] = ()  # other spellings users may type
    name_words: tuple[str, ...] = ()  # local words for listing names


CITIES: Final[tuple[City, ...]] = (
    City("Kyoto", "Japan", True, 120, ("京都", "Kyōto"),
         ("Sakura", "Kamo River", "Gion", "Higashiyama", "Arashiyama")),
    City("Tokyo", "Japan", False, 130, ("東京", "Tōkyō"),
         ("Asakusa", "Shinjuku", "Ueno Park", "Sumida", "Ginza")),
    City("Osaka", "Japan", False, 110, ("大阪", "Ōsaka"),
         ("Namba", "Dotonbori", "Umeda", "Castle View")),
    City("Hakone", "Japan", True, 125, ("箱根",),
         ("Ashi Lake", "Fuji View", "Gora", "Owakudani")),
    City("Sapporo", "Japan", True, 100, ("札幌",),
         ("Jozankei", "Snow Festival", "Odori", "Susukino")),
    City("Nara", "Japan", False, 100, ("奈良",),
         ("Deer Park", "Todaiji", "Naramachi", "Kasuga")),
    City("Beppu", "Japan", True, 90, ("別府",),
         ("Kannawa", "Steam Valley", "Yukemuri", "Bay View")),
    City("Kanazawa", "Japan", True, 105, ("金沢",),
         ("Kenrokuen", "Higashi Chaya", "Yuwaku", "Gold Leaf")),
    City("Fukuoka", "Japan", False, 95, ("福岡",),
         ("Hakata", "Tenjin", "Ohori Park", "Canal City")),
    City("Lisbon", "Portugal", False, 85, ("Lisboa",),
         ("Alfama", "Tagus", "Belem", "Chiado", "Tram 28")),
    City("Porto", "Portugal", False, 80, ("Oporto",),
         ("Ribeira", "Douro", "Azulejo", "Bolhao")),
    City("Paris", "France", False, 140, (),
         ("Montmartre", "Seine", "Le Marais", "Eiffel View")),
    City("Oslo", "Norway", False, 150, (),
         ("Fjord", "Aker Brygge", "Frogner", "Nordic")),
    City("Bergen", "Norway", False, 130, (),
         ("Bryggen", "Floyen", "Harbor View", "Seven Mountains")),
    City("Reykjavik", "Iceland", True, 160, ("Reykjavík",),
         ("Aurora", "Harpa", "Geyser", "Old Harbor")),
    City("Barcelona", "Spain", False, 110, ("Barcelone",),
         ("Gothic Quarter", "Ramblas", "Gaudi", "Sea Breeze")),
    City("Vienna", "Austria", False, 115, ("Wien",),
         ("Danube", "Ringstrasse", "Opera", "Belvedere")),
    City("Seoul", "South Korea", False, 100, ("서울",),
         ("Han River", "Bukchon", "Myeongdong", "Namsan")),
    City("Taipei", "Taiwan", True, 90, ("台北",),
         ("Beitou", "Daan Park", "Ximen", "Lantern")),
)  # fmt: skip
CITY_BY_NAME: Final[dict[str, City]] = {c.name: c for c in CITIES}

_GENERIC_NAME_WORDS: Final[tuple[str, ...]] = (
    "Central", "Garden", "Riverside", "Maple", "Park", "Old Town", "Blue Door", "Lantern",
    "Station", "Hilltop", "Willow", "Cedar",
)  # fmt: skip
_KIND_NAME_WORDS: Final[dict[str, tuple[str, ...]]] = {
    "hotel": ("Hotel", "Inn", "Suites"),
    "ryokan": ("Ryokan",),
    "hostel": ("Hostel", "Backpackers"),
    "guesthouse": ("Guesthouse", "Guest House"),
}


def _round_up_5(x: int) -> int:
    return -(-x // 5) * 5


def _kinds_in(city: City) -> tuple[str, ...]:
    return KINDS if city.country == "Japan" else tuple(k for k in KINDS if k != "ryokan")


def price_floor(city: str, kind: str, onsen: bool = False) -> int:
    """Cheapest price (USD, multiple of 5) of a ``kind`` in ``city``, with an onsen or not.

    Ignores whether such a place can exist (see :func:`infeasibility`).
    """
    return _FLOORS[city, kind, onsen]


_FLOORS: Final[dict[tuple[str, str, bool], int]] = {
    # The same floor in every city: 8 thresholds (kind x onsen) that a tiny model learns
    # from thousands of examples each, instead of 160 (city x kind x onsen) from dozens.
    (c.name, kind, onsen): _round_up_5(_KIND_BASE_PRICE[kind]) + (ONSEN_SURCHARGE if onsen else 0)
    for c in CITIES
    for kind in KINDS
    for onsen in (False, True)
}


# --------------------------------------------------------------------------------------------
# Requests and listings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HotelRequest:
    """What the user asked for in one turn (the assistant answers exactly this)."""

    city: str  # canonical name, a key of CITY_BY_NAME
    kind: str | None  # one of KINDS, or None for any kind
    max_price: int  # USD per night
    amenities: tuple[str, ...] = ()  # sorted, distinct names from AMENITIES

    def __post_init__(self) -> None:
        if self.city not in CITY_BY_NAME:
            raise ValueError(f"unknown city {self.city!r}")
        if self.kind is not None and self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}")
        if self.max_price <= 0:
            raise ValueError(f"max_price must be positive, got {self.max_price}")
        if any(a not in _AMENITY_SET for a in self.amenities):
            raise ValueError(f"unknown amenity in {self.amenities!r}")
        if list(self.amenities) != sorted(set(self.amenities)):
            raise ValueError(f"amenities must be sorted and distinct: {self.amenities!r}")


@dataclass(frozen=True)
class Listing:
    """One suggested place, as it appears in an answer line."""

    name: str
    kind: str
    price: int  # USD per night
    amenities: tuple[str, ...] = ()  # sorted


Infeasibility = Literal["ryokan_outside_japan", "no_hot_springs", "over_budget"]


def min_price(request: HotelRequest) -> int | None:
    """Cheapest possible price for ``request`` ignoring its budget; None if no such place exists."""
    city = CITY_BY_NAME[request.city]
    onsen = "onsen" in request.amenities
    if onsen and not city.hot_springs:
        return None
    kinds = _kinds_in(city) if request.kind is None else (request.kind,)
    if not set(kinds) <= set(_kinds_in(city)):
        return None
    return min(price_floor(city.name, k, onsen) for k in kinds)


def infeasibility(request: HotelRequest) -> Infeasibility | None:
    """Why the world has no place for ``request`` (first reason that applies), or None."""
    city = CITY_BY_NAME[request.city]
    if request.kind == "ryokan" and city.country != "Japan":
        return "ryokan_outside_japan"
    if "onsen" in request.amenities and not city.hot_springs:
        return "no_hot_springs"
    floor = min_price(request)
    if floor is None or floor > request.max_price:
        return "over_budget"
    return None


def is_feasible(request: HotelRequest) -> bool:
    """True iff at least one place in the world matches ``request``."""
    return infeasibility(request) is None


def listing_matches(request: HotelRequest, listing: Listing) -> bool:
    """Price within budget, all requested amenities present, kind as requested (if any)."""
    return (
        listing.price <= request.max_price
        and set(request.amenities) <= set(listing.amenities)
        and (request.kind is None or listing.kind == request.kind)
    )


def _one_word(words: Sequence[str]) -> tuple[str, ...]:
    return tuple(w for w in words if " " not in w)


def _listing_name(city: City, kind: str, rng: random.Random, one_word: bool) -> str:
    words = city.name_words if rng.random() < 0.7 else _GENERIC_NAME_WORDS
    kind_words = _KIND_NAME_WORDS[kind]
    if one_word:
        words = _one_word(words) or _one_word(_GENERIC_NAME_WORDS)
        kind_words = _one_word(kind_words)
    return f"{rng.choice(words)} {rng.choice(kind_words)}"


def feasible_listings(
    request: HotelRequest, rng: random.Random, *, search: bool = False
) -> list[Listing]:
    """Invent 1-3 places matching ``request``; ``[]`` if the world has none (see is_feasible).

    Prices are multiples of 5, at least the floor of their kind (and onsen) in the city and at
    most ``max_price``. Each listing has all requested amenities plus 0-2 others possible in the
    city; names are distinct within the list; listings are sorted by price, cheapest first.

    ``search``: what ``search_hotels`` finds instead: three places, each with exactly the
    requested amenities and a name of two one-word parts (see :func:`search_result`).
    """
    if not is_feasible(request):
        return []
    city = CITY_BY_NAME[request.city]
    onsen = "onsen" in request.amenities
    candidates = _kinds_in(city) if request.kind is None else (request.kind,)
    kinds = [k for k in candidates if price_floor(city.name, k, onsen) <= request.max_price]
    extras_pool = [
        a for a in AMENITIES if a not in request.amenities and (a != "onsen" or city.hot_springs)
    ]
    n = SEARCH_RESULTS if search else rng.choice((1, 2, 2, 3, 3))
    listings: list[Listing] = []
    names: set[str] = set()
    for _ in range(n):
        kind = rng.choice(kinds)
        # A search must find three (the city's own words can run out before the generic ones
        # come up); answers invent 1-3 and may settle for fewer.
        for _attempt in range(100 if search else 10):
            name = _listing_name(city, kind, rng, one_word=search)
            if name not in names:
                break
        else:
            continue
        names.add(name)
        extras = [] if search else rng.sample(extras_pool, rng.choice((0, 1, 1, 2)))
        has_onsen = onsen or "onsen" in extras
        floor = price_floor(city.name, kind, has_onsen)
        if floor > request.max_price:  # an extra onsen would break the budget: drop it
            extras = [a for a in extras if a != "onsen"]
            floor = price_floor(city.name, kind, onsen)
        top = min(request.max_price, floor * 3 * city.price_level // 100) // 5 * 5
        price = 5 * rng.randint(floor // 5, max(floor, top) // 5)
        amenities = tuple(sorted((*request.amenities, *extras)))
        listings.append(Listing(name, kind, price, amenities))
    listings.sort(key=lambda item: item.price)
    return listings


# --------------------------------------------------------------------------------------------
# Assistant answers
# --------------------------------------------------------------------------------------------

_AMENITY_ANSWER_PHRASE: Final[dict[str, str]] = {
    "airport shuttle": "an airport shuttle",
    "free breakfast": "free breakfast",
    "free wifi": "free wifi",
    "gym": "a gym",
    "onsen": "an onsen",
    "parking": "parking",
    "pets allowed": "pets allowed",
    "wheelchair access": "wheelchair access",
}


def _join_and(items: Sequence[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def _with_clause(request: HotelRequest) -> str:
    if not request.amenities:
        return ""
    return " with " + _join_and([_AMENITY_ANSWER_PHRASE[a] for a in request.amenities])


def _kinds_word(kind: str | None) -> str:
    return "places" if kind is None else _KIND_PLURAL[kind]


def _count_phrase(n: int, kind: str | None) -> str:
    if n == 1:
        return f"1 {'place' if kind is None else kind}"
    return f"{n} {_kinds_word(kind)}"


def listing_line(i: int, item: Listing, amenities: bool = True) -> str:
    """Listing ``i`` (from 1) as answers write it: ``2. Gion Ryokan (ryokan) - $135 a night -
    onsen``; without ``amenities``, as the tool's results and the answers from them do."""
    line = f"{i}. {item.name} ({item.kind}) - ${item.price} a night"
    return line + (" - " + ", ".join(item.amenities) if amenities and item.amenities else "")


def _subject(request: HotelRequest) -> str:
    """The restated request that opens every answer: "Ryokans in Kyoto under $200 a night
    with an onsen"."""
    kinds = _kinds_word(request.kind)
    return (
        f"{kinds[0].upper()}{kinds[1:]} in {request.city} under ${request.max_price} a night"
        f"{_with_clause(request)}"
    )


def format_answer(request: HotelRequest, listings: Sequence[Listing], rng: random.Random) -> str:
    """The assistant's answer: the listings (header + numbered lines) or a sorry line if empty.

    Every answer first restates the request, then decides ("I found 2" / "sorry"): a tiny
    model decides far better when the city, kind, budget and amenities it must weigh are
    the tokens right before the decision (the restatement works like a short chain of
    thought).
    """
    city, subject = request.city, _subject(request)
    if not listings:
        reason = infeasibility(request)
        if reason == "ryokan_outside_japan":
            return (
                f"{subject} - sorry, ryokans are only found in Japan, so there are none in "
                f"{city}. Would a hotel do?"
            )
        if reason == "no_hot_springs":
            tail = rng.choice(("", " Would you like a place without one?"))
            no_onsen = f"{city} has no hot springs, so no place there has an onsen"
            return f"{subject} - sorry, {no_onsen}.{tail}"
        lead = rng.choice(("I found none", "there are none"))
        return f"{subject} - sorry, {lead}. Would you like to raise your budget?"
    count = _count_phrase(len(listings), request.kind)
    verb = "is" if len(listings) == 1 else "are"
    header = rng.choice((f"I found {count}", f"here {verb} {count}", f"sure, I found {count}"))
    lines = [f"{subject} - {header}:"] + [
        listing_line(i, item) for i, item in enumerate(listings, 1)
    ]
    return "\n".join(lines)


def format_answer_from_result(
    request: HotelRequest, listings: Sequence[Listing], rng: random.Random
) -> str:
    """The answer after a ``search_hotels`` result that found ``listings``: its lines, copied.

    ``I found 3 ryokans:``, the result's lines word for word, and one line for the requested
    amenities that every place has (``All of them have an onsen and parking.``). Nothing of
    varying length stands between the result's lines and the answer's (see
    :func:`search_result`). An empty result gets :func:`format_answer`'s "sorry".
    """
    if not listings:
        return format_answer(request, [], rng)
    lines = [f"I found {_count_phrase(len(listings), request.kind)}:"]
    lines += [listing_line(i, item, amenities=False) for i, item in enumerate(listings, 1)]
    if request.amenities:
        phrases = [_AMENITY_ANSWER_PHRASE[a] for a in request.amenities]
        lines.append(f"{_ALL_HAVE}{_join_and(phrases)}.")
    return "\n".join(lines)


_ALL_HAVE: Final = "All of them have "
_AMENITY_OF_PHRASE: Final[dict[str, str]] = {v: k for k, v in _AMENITY_ANSWER_PHRASE.items()}
_SORRY_RE: Final[re.Pattern[str]] = re.compile(r"\bsorry\b", re.IGNORECASE)
_LISTING_RE: Final[re.Pattern[str]] = re.compile(
    r"^\s*\d+\. (?P<name>\S.*?) \((?P<kind>hotel|ryokan|hostel|guesthouse)\)"
    r" - \$(?P<price>\d+) a night(?: - (?P<amenities>.+?))?\s*$"
)


def parse_answer(text: str) -> list[Listing] | None:
    """Read an assistant answer back.

    Returns ``None`` for a no-match answer (one line saying "sorry"), otherwise the
    listings. Never raises: text that is neither -- no header line ending in ``:``, no listing
    line, or any later line that is not a well-formed listing line -- gives ``[]``. A last
    line ``All of them have ...`` (:func:`format_answer_from_result`) gives every listing
    those amenities.
    """
    stripped = text.strip()
    lines = [ln for ln in stripped.splitlines() if ln.strip()]
    if len(lines) == 1 and _SORRY_RE.search(lines[0]):
        return None
    shared: tuple[str, ...] = ()
    if len(lines) > 2 and lines[-1].startswith(_ALL_HAVE):
        found = _shared_amenities(lines.pop())
        if found is None:
            return []
        shared = found
    if len(lines) < 2 or not lines[0].rstrip().endswith(":"):
        return []
    listings: list[Listing] = []
    for line in lines[1:]:
        item = parse_listing_line(line)
        if item is None or (shared and item.amenities):
            return []
        listings.append(dataclasses.replace(item, amenities=shared) if shared else item)
    return listings


def _shared_amenities(line: str) -> tuple[str, ...] | None:
    """The amenities of an ``All of them have an onsen and parking.`` line, or ``None``."""
    body = line.strip().removeprefix(_ALL_HAVE).removesuffix(".")
    phrases = body.replace(" and ", ", ").split(", ")
    if not line.strip().endswith(".") or any(p not in _AMENITY_OF_PHRASE for p in phrases):
        return None
    return tuple(sorted({_AMENITY_OF_PHRASE[p] for p in phrases}))


def parse_listing_line(line: str) -> Listing | None:
    """The listing that :func:`listing_line` wrote, or ``None`` for any other text."""
    m = _LISTING_RE.match(line)
    if m is None:
        return None
    raw = m.group("amenities")
    amenities = tuple(sorted(a.strip() for a in raw.split(","))) if raw else ()
    return Listing(m.group("name"), m.group("kind"), int(m.group("price")), amenities)


def check_answer(request: HotelRequest, text: str) -> bool:
    """Whether ``text`` correctly answers ``request``.

    True iff the world has no match and ``text`` is a no-match answer, or it has one and ``text``
    parses to at least one listing, each within budget, with every requested amenity and of the
    requested kind (when one was requested).
    """
    parsed = parse_answer(text)
    if not is_feasible(request):
        return parsed is None
    if not parsed:
        return False
    return all(listing_matches(request, item) for item in parsed)


# --------------------------------------------------------------------------------------------
# User messages
# --------------------------------------------------------------------------------------------

_A_KIND: Final[dict[str | None, tuple[str, ...]]] = {
    None: ("a place", "somewhere to stay", "a room"),
    "hotel": ("a hotel",),
    "ryokan": ("a ryokan",),
    "hostel": ("a hostel",),
    "guesthouse": ("a guesthouse",),
}
_KINDS_PL: Final[dict[str | None, tuple[str, ...]]] = {
    None: ("places", "rooms", "places to stay"),
    "hotel": ("hotels",),
    "ryokan": ("ryokans",),
    "hostel": ("hostels",),
    "guesthouse": ("guesthouses",),
}
#: Phrases that read after "with".
_AMENITY_WITH: Final[dict[str, tuple[str, ...]]] = {
    "airport shuttle": ("an airport shuttle", "airport shuttle"),
    "free breakfast": ("free breakfast", "breakfast included"),
    "free wifi": ("free wifi", "free wi-fi", "wifi"),
    "gym": ("a gym",),
    "onsen": ("an onsen", "onsen"),
    "parking": ("parking", "a parking spot"),
    "pets allowed": ("pets allowed",),
    "wheelchair access": ("wheelchair access",),
}
#: Terse tags for lists ("Kyoto, onsen, pet friendly, under $200").
_AMENITY_TAG: Final[dict[str, tuple[str, ...]]] = {
    "airport shuttle": ("airport shuttle",),
    "free breakfast": ("free breakfast", "breakfast included"),
    "free wifi": ("free wifi", "wifi"),
    "gym": ("gym",),
    "onsen": ("onsen",),
    "parking": ("parking",),
    "pets allowed": ("pet friendly", "pets allowed"),
    "wheelchair access": ("wheelchair accessible", "wheelchair access"),
}
_BUDGETS: Final[tuple[str, ...]] = (
    "under ${p}",
    "below ${p}",
    "under ${p} a night",
    "max {p} dollars per night",
    "up to ${p} per night",
    "for less than ${p} a night",
    "no more than {p} USD a night",
    "with a budget of ${p}",
)
# (template, needs a kind word): templates without {a_kind}/{kinds}/{kind} only for kind None.
_USER_TEMPLATES: Final[tuple[tuple[str, bool], ...]] = (
    ("Find me {a_kind} in {city} {budget}{with_amen}.", True),
    ("I need {a_kind} in {city}, {budget}{tags} please", True),
    ("any {cheap}{kinds} in {city} {budget}{with_amen}?", True),
    ("{city}{tags}, {budget} — what do you have?", False),
    ("{city}, {kind}{tags}, {budget} — what do you have?", True),
    ("Can you recommend {a_kind} in {city} {budget}{with_amen}?", True),
    ("Looking for {a_kind} in {city}{with_amen}, {budget}.", True),
    ("I'm going to {city}. Is there {a_kind} {budget}{with_amen}?", True),
    ("Please suggest {cheap}{kinds} in {city} {budget}{with_amen}.", True),
    ("Where can I stay in {city} {budget}{with_amen}?", False),
    # short forms
    ("{A_kind} in {city} {budget}{with_amen}?", True),
    ("{Kinds} in {city} {budget}{with_amen}?", True),
    ("{city}: {kinds} {budget}{with_amen}", True),
    ("Is there {a_kind} in {city} {budget}{with_amen}?", True),
    ("A place to stay in {city} {budget}{with_amen}?", False),
    ("Somewhere in {city} {budget}{with_amen}?", False),
)


def _city_mention(city: City, rng: random.Random) -> str:
    if city.aliases and rng.random() < 0.2:
        return rng.choice(city.aliases)
    return city.name


def user_message(request: HotelRequest, rng: random.Random) -> str:
    """One user message asking for ``request``, in a randomly drawn phrasing."""
    city = CITY_BY_NAME[request.city]
    p = request.max_price
    templates = [t for t, needs_kind in _USER_TEMPLATES if needs_kind or request.kind is None]
    template = rng.choice(templates)
    with_amen = ""
    if request.amenities:
        with_amen = " with " + _join_and([rng.choice(_AMENITY_WITH[a]) for a in request.amenities])
    tags = "".join(", " + rng.choice(_AMENITY_TAG[a]) for a in request.amenities)
    a_kind = rng.choice(_A_KIND[request.kind])
    kinds = rng.choice(_KINDS_PL[request.kind])
    text = template.format(
        a_kind=a_kind,
        A_kind=a_kind[:1].upper() + a_kind[1:],
        kinds=kinds,
        Kinds=kinds[:1].upper() + kinds[1:],
        kind=request.kind or "any kind",
        city=_city_mention(city, rng),
        budget=rng.choice(_BUDGETS).format(p=p),
        with_amen=with_amen,
        tags=tags,
        cheap="cheap " if p <= 100 and rng.random() < 0.5 else "",
    )
    if rng.random() < 0.05:
        text = text.lower()
    return text


# --------------------------------------------------------------------------------------------
# Sampling requests and conversations
# --------------------------------------------------------------------------------------------

SYSTEM_PROMPTS: Final[tuple[str, ...]] = (
    "You are a helpful travel assistant. Suggest hotels that match the city, budget and amenities.",
    "You are a travel assistant. Recommend places to stay that match the user's city, budget "
    "and amenities.",
    "You help travelers find hotels. Only suggest places that fit the city, the budget and the "
    "requested amenities.",
)
_KIND_WEIGHTS_JAPAN: Final[tuple[int, ...]] = (20, 20, 15, 15)  # hotel ryokan hostel guesthouse
_KIND_WEIGHTS_ELSEWHERE: Final[tuple[int, ...]] = (27, 5, 19, 20)
_N_AMENITIES_WEIGHTS: Final[tuple[int, ...]] = (30, 35, 25, 10)  # 0, 1, 2, 3 amenities
_CAP_WEIGHTS: Final[tuple[int, ...]] = (16, 16, 14, 12, 12, 10, 8, 6, 6)
_FEASIBLE_SHARE: Final = 0.75  # of possible requests, the share drawn with a budget that fits


def sample_request(rng: random.Random) -> HotelRequest:
    """Draw one request from the training/evaluation distribution."""
    city = rng.choice(CITIES)
    kind: str | None = None
    if rng.random() >= 0.3:
        weights = _KIND_WEIGHTS_JAPAN if city.country == "Japan" else _KIND_WEIGHTS_ELSEWHERE
        kind = rng.choices(KINDS, weights)[0]
    n = rng.choices(range(4), _N_AMENITIES_WEIGHTS)[0]
    onsen_weight = 4.0 if city.hot_springs else 0.25
    pool = list(AMENITIES)
    amenity_weights = [onsen_weight if a == "onsen" else 1.0 for a in pool]
    chosen: list[str] = []
    for _ in range(n):
        i = rng.choices(range(len(pool)), amenity_weights)[0]
        chosen.append(pool.pop(i))
        amenity_weights.pop(i)
    amenities = tuple(sorted(chosen))
    # The budget is drawn against what the request costs at least: ~3 in 4 can be met.
    # Drawn blindly, expensive combinations (a ryokan with an onsen) were almost always
    # over budget, and the model learned "ryokan + onsen → sorry" whatever the budget.
    floor = min_price(HotelRequest(city.name, kind, max(PRICE_CAPS), amenities))
    if floor is None:
        cap = rng.choices(PRICE_CAPS, _CAP_WEIGHTS)[0]
    else:
        above = [c for c in PRICE_CAPS if c >= floor]
        below = [c for c in PRICE_CAPS if c < floor]
        cap = rng.choice(above if not below or rng.random() < _FEASIBLE_SHARE else below)
    return HotelRequest(city.name, kind, cap, amenities)


@dataclass
class Conversation:
    """OpenAI-style messages, the tools offered (None: no tools), and the structured request
    behind each user turn that asks for places (one per answer).

    Without tools every assistant turn is an answer. With tools each request takes three
    messages: an assistant turn whose ``tool_calls`` hold one ``search_hotels`` call (its
    ``arguments`` a mapping, as Hugging Face templates take it), the ``tool`` message with the
    result (JSON text), and the assistant's answer built from that result.
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    requests: list[HotelRequest] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class EvalPrompt:
    """A held-out prompt: the messages to complete (ending with a user turn) and its request."""

    request: HotelRequest
    messages: list[dict[str, Any]]


def _answer(
    request: HotelRequest, previous: Sequence[Listing], rng: random.Random
) -> tuple[list[Listing], str]:
    """Listings and text for ``request``; keeps the previous listings that still match."""
    kept = [item for item in previous if listing_matches(request, item)]
    listings = kept if kept else feasible_listings(request, rng)
    return listings, format_answer(request, listings, rng)


def _follow_up(request: HotelRequest, rng: random.Random) -> tuple[HotelRequest, str] | None:
    """A second user turn refining ``request`` (and the refined request), or None."""
    city = CITY_BY_NAME[request.city]
    reason = infeasibility(request)
    if reason == "ryokan_outside_japan":
        kind = rng.choice(("hotel", "guesthouse", "hostel"))
        text = rng.choice(("Then {a} is fine.", "OK, what about {a}?")).format(a=f"a {kind}")
        return HotelRequest(request.city, kind, request.max_price, request.amenities), text
    if reason == "no_hot_springs":
        text = rng.choice(("OK, forget the onsen.", "Then without the onsen, please."))
        amenities = tuple(a for a in request.amenities if a != "onsen")
        return HotelRequest(request.city, request.kind, request.max_price, amenities), text
    if reason == "over_budget":
        higher = [c for c in PRICE_CAPS if c > request.max_price]
        if not higher:
            return None
        cap = rng.choice(higher)
        text = rng.choice(
            ("Yes, I can go up to ${p}.", "OK, what about under ${p}?", "Fine, make it ${p}.")
        ).format(p=cap)
        return HotelRequest(request.city, request.kind, cap, request.amenities), text
    lower = [c for c in PRICE_CAPS if c < request.max_price]
    missing = [
        a for a in AMENITIES if a not in request.amenities and (a != "onsen" or city.hot_springs)
    ]
    if lower and (rng.random() < 0.5 or len(request.amenities) >= 3):
        cap = rng.choice(lower[-3:])
        text = rng.choice(
            (
                "Anything cheaper, under ${p}?",
                "Can you find something under ${p}?",
                "That's too expensive. Max ${p} please.",
            )
        ).format(p=cap)
        return HotelRequest(request.city, request.kind, cap, request.amenities), text
    if len(request.amenities) >= 3 or not missing:
        return None
    amenity = rng.choice(missing)
    phrase = _AMENITY_ANSWER_PHRASE[amenity]
    text = rng.choice(
        (
            "Which of those have {x}?",
            "Do any of them have {x}?",
            "I also need {x}.",
            "Only ones with {x}, please.",
        )
    ).format(x=phrase)
    amenities = tuple(sorted((*request.amenities, amenity)))
    return HotelRequest(request.city, request.kind, request.max_price, amenities), text


def generate_conversation(rng: random.Random) -> Conversation:
    """One conversation: optional system prompt, a request, the answer, ~25% a follow-up turn."""
    conv = Conversation()
    if rng.random() < 0.5:
        conv.messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    request = sample_request(rng)
    conv.messages.append({"role": "user", "content": user_message(request, rng)})
    listings, text = _answer(request, (), rng)
    conv.messages.append({"role": "assistant", "content": text})
    conv.requests.append(request)
    if rng.random() < 0.25:
        follow = _follow_up(request, rng)
        if follow is not None:
            request, question = follow
            _, text = _answer(request, listings, rng)
            conv.messages.append({"role": "user", "content": question})
            conv.messages.append({"role": "assistant", "content": text})
            conv.requests.append(request)
    return conv


# --------------------------------------------------------------------------------------------
# Tool use: the search_hotels tool, its local implementation, tool conversations
# --------------------------------------------------------------------------------------------

#: The tool the demo model learned to call, in OpenAI's ``tools`` shape. The model knows only
#: this definition, rendered exactly so (see ``tokenizer.CHAT_TEMPLATE``); kept short because
#: every tool conversation repeats it.
SEARCH_HOTELS_TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "function": {
        "name": "search_hotels",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "max_price": {"type": "integer"},
                "kind": {"type": "string", "enum": list(KINDS)},
                "amenities": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city", "max_price"],
        },
    },
}
#: Of the training conversations of the tool recipe (``train.TOOL_RECIPE``), the share that
#: offers the tool.
TOOL_SHARE: Final = 0.4
_CITY_BY_ANY_NAME: Final[dict[str, City]] = {
    name.casefold(): c for c in CITIES for name in (c.name, *c.aliases)
}


def tool_arguments(request: HotelRequest) -> dict[str, Any]:
    """The ``search_hotels`` arguments that ask for exactly ``request``.

    Key order is fixed (city, max_price, kind, amenities): the model learns one layout. The
    city is canonical; ``kind`` is left out for "any kind"; ``amenities`` is always there.
    """
    args: dict[str, Any] = {"city": request.city, "max_price": request.max_price}
    if request.kind is not None:
        args["kind"] = request.kind
    args["amenities"] = list(request.amenities)
    return args


def _request_from_arguments(arguments: Mapping[str, Any]) -> HotelRequest | str:
    """The request that ``search_hotels`` arguments ask for, or why they are not valid."""
    unknown = sorted(set(arguments) - {"city", "max_price", "kind", "amenities"})
    if unknown:
        return f"unknown argument {unknown[0]!r}"
    city = arguments.get("city")
    found = _CITY_BY_ANY_NAME.get(city.strip().casefold()) if isinstance(city, str) else None
    if found is None:
        return f"unknown city {city!r}"
    price = arguments.get("max_price")
    if isinstance(price, bool) or not isinstance(price, int) or price <= 0:
        return "max_price must be a positive integer"
    kind = arguments.get("kind")
    if kind is not None and kind not in KINDS:
        return f"kind must be one of {', '.join(KINDS)}"
    amenities = arguments.get("amenities") or []
    if not isinstance(amenities, list) or any(
        not isinstance(a, str) or a not in _AMENITY_SET for a in amenities
    ):
        return f"amenities must be a list of: {', '.join(AMENITIES)}"
    return HotelRequest(found.name, kind, price, tuple(sorted(set(amenities))))


#: How many places a ``search_hotels`` result lists when the world has any.
SEARCH_RESULTS: Final = 3


def search_result(request: HotelRequest, listings: Sequence[Listing]) -> str:
    """The tool result for ``request`` that found ``listings``: the text the model reads.

    A header line (``3 ryokans in Kyoto under $200 a night, all with onsen:``), then one line
    per place as the answer lists it, without amenities (the header says which every place
    has). Or one line saying why there is nothing: the world has no such place (no ryokans
    outside Japan, no onsen without hot springs) or none within the budget.

    Why this shape: a model this small did not learn to find a result line by its content
    and copy it (the model card). But it learns to copy from a fixed distance back. A result
    has three lines of 13 tokens each (one-word name parts, no amenities), and the answer
    puts them right after a header of fixed length (:func:`format_answer_from_result`), so
    every token of an answer's list sits the same distance after its twin in the result.
    """
    if not listings:
        reason = infeasibility(request)
        if reason == "ryokan_outside_japan":
            return "No results: ryokans are only found in Japan."
        if reason == "no_hot_springs":
            return f"No results: {request.city} has no hot springs."
        return f"No results in {request.city} under ${request.max_price} a night."
    amenities = f", all with {', '.join(request.amenities)}" if request.amenities else ""
    head = (
        f"{_count_phrase(len(listings), request.kind)} in {request.city} under "
        f"${request.max_price} a night{amenities}:"
    )
    lines = [listing_line(i, item, amenities=False) for i, item in enumerate(listings, 1)]
    return "\n".join([head, *lines])


_RESULT_AMENITIES_RE: Final[re.Pattern[str]] = re.compile(r", all with (?P<amenities>.+):$")


def result_listings(result: str) -> list[Listing]:
    """The places in a :func:`search_result`: its lines read back, each with the header's
    amenities (a result's lines carry none of their own)."""
    lines = result.splitlines()
    m = _RESULT_AMENITIES_RE.search(lines[0]) if lines else None
    amenities = tuple(sorted(m.group("amenities").split(", "))) if m else ()
    items = [parse_listing_line(line) for line in lines[1:]]
    return [dataclasses.replace(x, amenities=amenities) for x in items if x is not None]


def search_hotels(arguments: Mapping[str, Any], rng: random.Random) -> str:
    """Run ``search_hotels`` over the world model: what ``kvserve chat --tools`` answers.

    Accepts any city name users type (aliases too, case-insensitively); invalid arguments
    give ``Error: ...`` text instead of raising.
    """
    request = _request_from_arguments(arguments)
    if isinstance(request, str):
        return f"Error: {request}"
    return search_result(request, feasible_listings(request, rng, search=True))


def _call_id(rng: random.Random) -> str:
    return f"call_{rng.getrandbits(64):016x}"


def _tool_round(conv: Conversation, request: HotelRequest, rng: random.Random) -> list[Listing]:
    """Append the call for ``request``, its result and the answer; returns the listings."""
    call_id = _call_id(rng)
    call = {"name": "search_hotels", "arguments": tool_arguments(request)}
    conv.messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": call}],
        }
    )
    listings = feasible_listings(request, rng, search=True)
    result = search_result(request, listings)
    conv.messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    answer = format_answer_from_result(request, listings, rng)
    conv.messages.append({"role": "assistant", "content": answer})
    conv.requests.append(request)
    return listings


def _one_tool_request(rng: random.Random) -> Conversation:
    """A tool conversation's start: optional system prompt, a request, the call, its result,
    the answer from it."""
    conv = Conversation(tools=[SEARCH_HOTELS_TOOL])
    if rng.random() < 0.5:
        conv.messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    request = sample_request(rng)
    conv.messages.append({"role": "user", "content": user_message(request, rng)})
    _tool_round(conv, request, rng)
    return conv


def _second_tool_round(conv: Conversation, rng: random.Random) -> None:
    """Append a second request, its call, the result and the answer (for evaluation: the
    training conversations have one request): half of them refine the first request
    (:func:`_follow_up`: "Anything cheaper, under $100?"), the others (and those with no
    refinement to make) ask anew."""
    follow = _follow_up(conv.requests[0], rng) if rng.random() < 0.5 else None
    if follow is None:
        request = sample_request(rng)
        text = user_message(request, rng)
    else:
        request, text = follow
    conv.messages.append({"role": "user", "content": text})
    _tool_round(conv, request, rng)


def generate_tool_conversation(rng: random.Random) -> Conversation:
    """One conversation that offers ``search_hotels``: optional system prompt, a request, the
    call, its result, the answer from it.

    One request per conversation. Two rounds fit the 512-token context (at most ~480
    tokens), but training on 30% of them (half refining the first request) made the calls'
    cities wrong: tool-call accuracy fell from 96% to 12%, and the second requests' calls
    were right in 6% (the model card).
    """
    return _one_tool_request(rng)


@dataclass(frozen=True)
class ToolEvalPrompt:
    """A held-out tool prompt: ``messages`` (ending with a user turn) offer ``tools``; the
    reference call for ``request`` and its result are ``call_and_result`` (two messages), so
    ``messages + call_and_result`` asks for the answer, which must come from ``listings``."""

    request: HotelRequest
    messages: list[dict[str, Any]]
    call_and_result: list[dict[str, Any]]
    listings: list[Listing]
    tools: list[dict[str, Any]]


def tool_eval_rng(seed: int) -> random.Random:
    """The random stream of the tool evaluation prompts for ``seed`` (its own, like
    :func:`eval_rng`'s)."""
    return random.Random(f"kvserve-demo-eval-tools:{seed}")


def sample_tool_eval_prompts(n: int, seed: int = 0) -> list[ToolEvalPrompt]:
    """``n`` single-request tool prompts (stream :func:`tool_eval_rng`)."""
    rng = tool_eval_rng(seed)
    return [_last_round_prompt(_one_tool_request(rng)) for _ in range(n)]


def tool_follow_up_eval_rng(seed: int) -> random.Random:
    """The random stream of the second-request tool evaluation prompts for ``seed``."""
    return random.Random(f"kvserve-demo-eval-tools-2:{seed}")


def sample_tool_follow_up_prompts(n: int, seed: int = 0) -> list[ToolEvalPrompt]:
    """``n`` tool prompts that ask a second request after a first whole round (stream
    :func:`tool_follow_up_eval_rng`): ``request`` is the second one."""
    rng = tool_follow_up_eval_rng(seed)
    prompts: list[ToolEvalPrompt] = []
    for _ in range(n):
        conv = _one_tool_request(rng)
        _second_tool_round(conv, rng)
        prompts.append(_last_round_prompt(conv))
    return prompts


def _last_round_prompt(conv: Conversation) -> ToolEvalPrompt:
    """``conv`` up to its last request, with that request's call and result held apart."""
    split = len(conv.messages) - 3  # call, result, answer
    return ToolEvalPrompt(
        conv.requests[-1],
        conv.messages[:split],
        conv.messages[split : split + 2],
        _listings_of(conv.messages[split + 1]),
        [SEARCH_HOTELS_TOOL],
    )


def _listings_of(tool_message: Mapping[str, Any]) -> list[Listing]:
    return result_listings(str(tool_message["content"]))


def train_rng(seed: int) -> random.Random:
    """The random stream of the training corpus for ``seed``."""
    return random.Random(f"kvserve-demo-train:{seed}")


def eval_rng(seed: int) -> random.Random:
    """The random stream of evaluation prompts for ``seed`` (independent of :func:`train_rng`)."""
    return random.Random(f"kvserve-demo-eval:{seed}")


def generate_corpus(n: int, seed: int = 0, tool_share: float = 0.0) -> list[Conversation]:
    """``n`` training conversations, identical for the same ``seed`` (stream :func:`train_rng`);
    a share ``tool_share`` of them (e.g. :data:`TOOL_SHARE`) offers the ``search_hotels`` tool.

    With ``tool_share`` 0 no draw decides the kind of conversation, so the corpus is the
    one the bundled checkpoint was trained on.
    """
    rng = train_rng(seed)
    return [
        generate_tool_conversation(rng)
        if tool_share > 0 and rng.random() < tool_share
        else generate_conversation(rng)
        for _ in range(n)
    ]


def sample_requests(n: int, seed: int = 0) -> list[HotelRequest]:
    """``n`` evaluation requests: those of ``sample_eval_prompts(n, seed)``, in order."""
    return [p.request for p in sample_eval_prompts(n, seed)]


def sample_eval_prompts(n: int, seed: int = 0) -> list[EvalPrompt]:
    """``n`` single-turn evaluation prompts (stream :func:`eval_rng`), system prompt in ~half."""
    rng = eval_rng(seed)
    prompts: list[EvalPrompt] = []
    for _ in range(n):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        request = sample_request(rng)
        messages.append({"role": "user", "content": user_message(request, rng)})
        prompts.append(EvalPrompt(request, messages))
    return prompts
