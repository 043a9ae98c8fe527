"""Tests for the demo model's corpus generator, world model and answer checker."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvserve.demo_model.corpus import (
    AMENITIES,
    CITIES,
    CITY_BY_NAME,
    KINDS,
    PRICE_CAPS,
    TOOL_SHARE,
    Conversation,
    HotelRequest,
    Listing,
    check_answer,
    feasible_listings,
    format_answer,
    format_answer_from_result,
    generate_conversation,
    generate_corpus,
    infeasibility,
    is_feasible,
    listing_matches,
    parse_answer,
    price_floor,
    sample_eval_prompts,
    sample_request,
    sample_requests,
    train_rng,
    user_message,
)

N = 3000  # conversations in the shared corpus (~0.5 s to generate)


@pytest.fixture(scope="module")
def corpus() -> list[Conversation]:
    return generate_corpus(N, seed=0, tool_share=TOOL_SHARE)  # plain and tool conversations


def _turns(corpus: list[Conversation]) -> list[tuple[HotelRequest, str]]:
    """(request, answer) of every answer, tool conversations' answers from results too."""
    out: list[tuple[HotelRequest, str]] = []
    for conv in corpus:
        answers = [
            m["content"]
            for m in conv.messages
            if m["role"] == "assistant" and not m.get("tool_calls")
        ]
        assert len(answers) == len(conv.requests)
        out.extend(zip(conv.requests, answers, strict=True))
    return out


def test_without_tools_the_corpus_is_the_bundled_models() -> None:
    # tool_share 0 draws nothing extra: the conversations the bundled checkpoint learned.
    rng = train_rng(0)
    assert generate_corpus(300, seed=0) == [generate_conversation(rng) for _ in range(300)]
    assert not any(c.tools for c in generate_corpus(300, seed=0))
    with_tools = generate_corpus(300, seed=0, tool_share=TOOL_SHARE)
    assert with_tools != generate_corpus(300, seed=0)
    assert with_tools == generate_corpus(300, seed=0, tool_share=TOOL_SHARE)


def test_same_seed_same_corpus_different_seed_different() -> None:
    a = generate_corpus(200, seed=3)
    assert a == generate_corpus(200, seed=3)
    assert a != generate_corpus(200, seed=4)
    # Only the generator's own Random is used: global random state changes nothing.
    random.seed(12345)
    assert a == generate_corpus(200, seed=3)


def test_messages_are_well_formed(corpus: list[Conversation]) -> None:
    for conv in corpus:
        roles = [m["role"] for m in conv.messages]
        if roles[0] == "system":
            roles = roles[1:]
        if conv.tools is None:
            assert roles in (["user", "assistant"], ["user", "assistant"] * 2)
            assert all(set(m) == {"role", "content"} and m["content"] for m in conv.messages)
        else:  # the tool conversations' shape is checked in test_tool_use.py
            assert roles == ["user", "assistant", "tool", "assistant"]


def test_mix_of_system_prompts_follow_ups_and_answer_kinds(corpus: list[Conversation]) -> None:
    with_system = sum(c.messages[0]["role"] == "system" for c in corpus) / N
    plain = [c for c in corpus if c.tools is None]
    with_tools = 1 - len(plain) / N
    follow_ups = sum(len(c.requests) == 2 for c in plain) / len(plain)
    assert 0.4 < with_system < 0.6
    assert TOOL_SHARE - 0.05 < with_tools < TOOL_SHARE + 0.05
    assert 0.18 < follow_ups < 0.3
    reasons = Counter(infeasibility(r) for r, _ in _turns(corpus))
    assert set(reasons) == {None, "over_budget", "no_hot_springs", "ryokan_outside_japan"}
    no_match = 1 - reasons[None] / sum(reasons.values())
    assert 0.1 < no_match < 0.35


def test_every_assistant_turn_passes_check_answer(corpus: list[Conversation]) -> None:
    for request, answer in _turns(corpus):
        assert check_answer(request, answer), (request, answer)


def test_infeasible_requests_get_no_match_answer(corpus: list[Conversation]) -> None:
    for request, answer in _turns(corpus):
        parsed = parse_answer(answer)
        if is_feasible(request):
            assert parsed, answer
        else:
            assert parsed is None, answer
            assert " - sorry, " in answer and "\n" not in answer
            assert request.city in answer


def test_listings_follow_the_world_rules(corpus: list[Conversation]) -> None:
    for request, answer in _turns(corpus):
        city = CITY_BY_NAME[request.city]
        for item in parse_answer(answer) or []:
            if not city.hot_springs:
                assert "onsen" not in item.amenities, answer
            if item.kind == "ryokan":
                assert city.country == "Japan", answer
            assert item.price % 5 == 0
            assert item.price <= request.max_price
            assert item.price >= price_floor(city.name, item.kind, "onsen" in item.amenities)
            assert set(item.amenities) <= set(AMENITIES)


def test_answers_are_short_and_name_the_canonical_city(corpus: list[Conversation]) -> None:
    for conv in corpus:
        for request, answer in _turns([conv]):
            assert len(answer.split()) <= 80, answer
            # An answer restates the request, except one that copies a search result's list.
            copies = conv.tools is not None and answer.startswith("I found ")
            assert request.city in answer.splitlines()[0] or copies, answer


def test_user_messages_mention_city_and_budget(corpus: list[Conversation]) -> None:
    aliases_used = 0
    for conv in corpus:
        first_user = next(m["content"] for m in conv.messages if m["role"] == "user")
        request = conv.requests[0]
        city = CITY_BY_NAME[request.city]
        names = (city.name, *city.aliases)
        assert any(n.lower() in first_user.lower() for n in names), first_user
        aliases_used += city.name.lower() not in first_user.lower()
        assert str(request.max_price) in first_user
    assert aliases_used > 0


def test_follow_up_answers_reuse_previous_listings_when_they_still_match(
    corpus: list[Conversation],
) -> None:
    reused = 0
    for conv in corpus:
        if len(conv.requests) < 2:
            continue
        first, second = conv.requests
        assert first.city == second.city
        answers = [m["content"] for m in conv.messages if m["role"] == "assistant"]
        before, after = parse_answer(answers[0]), parse_answer(answers[1])
        if before and after:
            still_ok = [item for item in before if listing_matches(second, item)]
            if still_ok:
                assert after == still_ok
                reused += 1
    assert reused > 0


def _as_answer(request: HotelRequest, *listings: Listing) -> str:
    return format_answer(request, list(listings), random.Random(0))


def test_feasible_listings_directly() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        request = sample_request(rng)
        listings = feasible_listings(request, rng)
        if not is_feasible(request):
            assert listings == []
            continue
        assert 1 <= len(listings) <= 3
        assert len({item.name for item in listings}) == len(listings)
        for item in listings:
            assert item.price <= request.max_price and item.price % 5 == 0
            assert set(request.amenities) <= set(item.amenities)
            assert len(item.amenities) - len(request.amenities) <= 2
            assert request.kind in (None, item.kind)
            assert item.amenities == tuple(sorted(item.amenities))


def test_search_listings_are_three_places_with_the_requested_amenities() -> None:
    rng = random.Random(6)
    for _ in range(2000):
        request = sample_request(rng)
        listings = feasible_listings(request, rng, search=True)
        if not is_feasible(request):
            assert listings == []
            continue
        assert len({item.name for item in listings}) == len(listings) == 3
        assert [item.price for item in listings] == sorted(item.price for item in listings)
        for item in listings:
            assert listing_matches(request, item) and item.amenities == request.amenities
            assert len(item.name.split()) == 2  # one-word parts: lines of one token count


def test_answers_from_results_read_back_with_the_shared_amenities() -> None:
    request = HotelRequest("Kyoto", None, 200, ("free wifi", "onsen"))
    listings = [
        Listing("Gion Ryokan", "ryokan", 135, request.amenities),
        Listing("Kamo Inn", "hotel", 150, request.amenities),
    ]
    text = format_answer_from_result(request, listings, random.Random(0))
    assert text == (
        "I found 2 places:\n1. Gion Ryokan (ryokan) - $135 a night\n"
        "2. Kamo Inn (hotel) - $150 a night\nAll of them have free wifi and an onsen."
    )
    assert parse_answer(text) == listings and check_answer(request, text)
    assert not check_answer(request, text.replace(" and an onsen", ""))  # onsen not stated
    for bad in ("All of them have a pool.", "All of them have an onsen"):
        assert parse_answer(text.rsplit("\n", 1)[0] + "\n" + bad) == []
    # A line's own amenities and a shared line do not mix.
    mixed = text.replace("a night\n2.", "a night - gym\n2.")
    assert parse_answer(mixed) == []
    no_amenities = HotelRequest("Kyoto", None, 200)
    plain = format_answer_from_result(no_amenities, [listings[0]], random.Random(0))
    assert plain == "I found 1 place:\n1. Gion Ryokan (ryokan) - $135 a night"


def test_world_examples() -> None:
    assert is_feasible(HotelRequest("Kyoto", "ryokan", 400, ("onsen",)))
    assert not is_feasible(HotelRequest("Kyoto", "ryokan", 80, ("onsen",)))
    assert infeasibility(HotelRequest("Paris", "ryokan", 400)) == "ryokan_outside_japan"
    assert infeasibility(HotelRequest("Paris", None, 400, ("onsen",))) == "no_hot_springs"
    assert infeasibility(HotelRequest("Oslo", "hotel", 50)) == "over_budget"
    assert price_floor("Kyoto", "ryokan", onsen=True) >= 90
    for city in CITIES:
        for kind in KINDS:
            assert price_floor(city.name, kind) % 5 == 0
            assert price_floor(city.name, kind, True) > price_floor(city.name, kind)
    # The largest budget always suffices when the kind and amenities exist in the city.
    assert all(is_feasible(HotelRequest(c.name, "hotel", max(PRICE_CAPS))) for c in CITIES)


def test_hotel_request_validation() -> None:
    with pytest.raises(ValueError):
        HotelRequest("Atlantis", None, 100)
    with pytest.raises(ValueError):
        HotelRequest("Kyoto", "castle", 100)
    with pytest.raises(ValueError):
        HotelRequest("Kyoto", None, 100, ("onsen", "gym"))  # not sorted
    with pytest.raises(ValueError):
        HotelRequest("Kyoto", None, 100, ("sauna",))


SPEC_EXAMPLE = """\
Places in Kyoto under $200 a night with an onsen - here are 2:
1. Sakura Ryokan (ryokan) - $150 a night - onsen, free breakfast
2. Kamo River Inn (hotel) - $120 a night - onsen, free wifi"""


def test_parse_answer() -> None:
    assert parse_answer(SPEC_EXAMPLE) == [
        Listing("Sakura Ryokan", "ryokan", 150, ("free breakfast", "onsen")),
        Listing("Kamo River Inn", "hotel", 120, ("free wifi", "onsen")),
    ]
    no_extras = (
        "Places in Porto under $400 a night - I found 1 place:\n1. Douro Inn (hotel) - $120 a night"
    )
    assert parse_answer(no_extras) == [Listing("Douro Inn", "hotel", 120, ())]
    sorry = "Places in Paris under $300 a night - sorry, Paris has no hot springs."
    assert parse_answer(sorry) is None
    assert parse_answer("Sorry:\n1. Douro Inn (hotel) - $120 a night") == [
        Listing("Douro Inn", "hotel", 120, ())
    ]
    for junk in ("", "asdf qwer", "Here:\n1. Foo (castle) - $10 a night", SPEC_EXAMPLE + "\nblah"):
        assert parse_answer(junk) == []


def test_check_answer_accepts_and_rejects() -> None:
    request = HotelRequest("Kyoto", "ryokan", 200, ("onsen",))
    good = Listing("Sakura Ryokan", "ryokan", 150, ("free breakfast", "onsen"))
    assert check_answer(request, _as_answer(request, good))
    over_cap = Listing("Sakura Ryokan", "ryokan", 205, ("onsen",))
    assert not check_answer(request, _as_answer(request, good, over_cap))
    missing = Listing("Gion Ryokan", "ryokan", 150, ("free breakfast",))
    assert not check_answer(request, _as_answer(request, missing))
    wrong_kind = Listing("Gion Inn", "hotel", 150, ("onsen",))
    assert not check_answer(request, _as_answer(request, wrong_kind))
    assert check_answer(HotelRequest("Kyoto", None, 200, ("onsen",)), SPEC_EXAMPLE)
    for junk in ("", "gibberish gibberish", "1. Sakura", "Here are 0 places:"):
        assert not check_answer(request, junk)
    # A no-match answer is wrong when places exist, right when none do.
    assert not check_answer(request, _as_answer(request))
    impossible = HotelRequest("Kyoto", "ryokan", 50, ("onsen",))
    assert check_answer(impossible, _as_answer(impossible))
    assert not check_answer(impossible, _as_answer(impossible, good))
    paris = HotelRequest("Paris", None, 300, ("onsen",))
    assert " - sorry, Paris has no hot springs" in _as_answer(paris)
    assert check_answer(paris, _as_answer(paris))


def test_eval_prompts_are_deterministic_and_use_their_own_stream() -> None:
    prompts = sample_eval_prompts(300, seed=0)
    assert prompts == sample_eval_prompts(300, seed=0)
    assert sample_requests(300, seed=0) == [p.request for p in prompts]
    assert sample_requests(300, seed=0) != sample_requests(300, seed=1)
    train_first_requests = [c.requests[0] for c in generate_corpus(300, seed=0)]
    assert sample_requests(300, seed=0) != train_first_requests
    for p in prompts:
        assert p.messages[-1]["role"] == "user"
        assert [m["role"] for m in p.messages] in (["user"], ["system", "user"])


def test_user_message_phrasing_varies() -> None:
    rng = random.Random(0)
    request = HotelRequest("Lisbon", "hotel", 120, ("wheelchair access",))
    messages = {user_message(request, rng) for _ in range(200)}
    assert len(messages) > 30
    assert any("Lisboa" in m for m in messages)
