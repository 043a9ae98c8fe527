"""The demo corpus's tool conversations, the local search_hotels, and how calls are graded."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.demo_model.corpus import (
    CITY_BY_NAME,
    SEARCH_HOTELS_TOOL,
    SEARCH_RESULTS,
    TOOL_SHARE,
    Conversation,
    HotelRequest,
    Listing,
    check_answer,
    generate_corpus,
    infeasibility,
    listing_matches,
    parse_answer,
    result_listings,
    sample_eval_prompts,
    sample_tool_eval_prompts,
    sample_tool_follow_up_prompts,
    search_hotels,
    tool_arguments,
)
from kvserve.demo_model.tokenizer import render_conversation
from kvserve.demo_model.tool_call import ToolCall, call_satisfies, parse_tool_call


@pytest.fixture(scope="module")
def tool_conversations() -> list[Conversation]:
    convs = [c for c in generate_corpus(2000, seed=0, tool_share=TOOL_SHARE) if c.tools]
    assert len(convs) > 300
    return convs


def _listings(result: str) -> list[Listing]:
    listings = result_listings(result)
    assert len(listings) == len(result.splitlines()) - 1, result  # every line reads back
    return listings


def test_tool_conversations_call_with_the_request_and_answer_from_the_result(
    tool_conversations: list[Conversation],
) -> None:
    notes = 0
    for conv in tool_conversations:
        assert conv.tools == [SEARCH_HOTELS_TOOL]
        (request,) = conv.requests
        call_turn, result, answer = conv.messages[-3:]
        assert call_turn["role"] == "assistant" and call_turn["content"] is None
        (call,) = call_turn["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"] == {"name": "search_hotels", "arguments": tool_arguments(request)}
        assert call_satisfies(request, ToolCall("search_hotels", call["function"]["arguments"]))
        assert result == {"role": "tool", "tool_call_id": call["id"], "content": result["content"]}
        listings = _listings(result["content"])
        assert all(listing_matches(request, item) for item in listings)
        assert len(listings) in (0, SEARCH_RESULTS)
        notes += result["content"].startswith("No results: ")  # the world has no such place
        # The answer lists exactly the result's places, or says sorry when there are none.
        assert answer["role"] == "assistant" and check_answer(request, answer["content"])
        assert parse_answer(answer["content"]) == (listings or None)
        if listings:  # ... by copying the result's lines, in order
            lines = result["content"].splitlines()[1:]
            assert answer["content"].splitlines()[1 : 1 + len(lines)] == lines
    assert notes > 0


def test_answers_copy_the_result_from_one_fixed_distance(
    tool_conversations: list[Conversation],
) -> None:
    """Why results look the way they do (corpus.search_result): with the bundled tokenizer,
    every token of an answer's list is the same number of tokens after its twin in the
    result, in every tool conversation."""
    from tokenizers import Tokenizer

    from kvserve.demo_model import DEMO_MODEL_DIR

    tok = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    distances = set()
    for conv in tool_conversations:
        result, answer = (m["content"] for m in conv.messages[-2:])
        if result.startswith("No results"):
            continue
        text = render_conversation(conv.messages, tools=conv.tools)
        enc = tok.encode(text, add_special_tokens=False)
        lines = "\n".join(result.splitlines()[1:])
        start_in_result = text.index(result) + result.index("\n") + 1
        start_in_answer = text.rindex(answer) + answer.index("\n") + 1
        first = [
            next(i for i, (a, _) in enumerate(enc.offsets) if a >= start)
            for start in (start_in_result, start_in_answer)
        ]
        n = len(tok.encode(lines, add_special_tokens=False).ids)
        assert enc.ids[first[0] : first[0] + n] == enc.ids[first[1] : first[1] + n]
        distances.add(first[1] - first[0])
    assert len(distances) == 1, distances


def test_tool_arguments_layout() -> None:
    request = HotelRequest("Kyoto", "ryokan", 200, ("onsen",))
    assert json.dumps(tool_arguments(request)) == (
        '{"city": "Kyoto", "max_price": 200, "kind": "ryokan", "amenities": ["onsen"]}'
    )
    assert tool_arguments(HotelRequest("Paris", None, 100)) == {
        "city": "Paris",
        "max_price": 100,
        "amenities": [],
    }


def test_search_hotels_follows_the_world_and_takes_what_users_type() -> None:
    rng = random.Random(0)
    request = HotelRequest("Kyoto", "ryokan", 200, ("onsen",))
    for city in ("Kyoto", "京都", "kyoto ", "Kyōto"):
        args = {"city": city, "max_price": 200, "kind": "ryokan", "amenities": ["onsen"]}
        result = search_hotels(args, rng)
        assert result.startswith("3 ryokans in Kyoto under $200 a night, all with onsen:\n1. ")
        items = _listings(result)
        assert len(items) == SEARCH_RESULTS
        assert all(listing_matches(request, item) for item in items)
    paris = search_hotels({"city": "Paris", "max_price": 300, "amenities": ["onsen"]}, rng)
    assert paris == "No results: Paris has no hot springs."
    ryokan = search_hotels({"city": "Oslo", "max_price": 300, "kind": "ryokan"}, rng)
    assert ryokan == "No results: ryokans are only found in Japan."
    too_low = search_hotels({"city": "Kyoto", "max_price": 50, "kind": "ryokan"}, rng)
    assert too_low == "No results in Kyoto under $50 a night."
    assert infeasibility(HotelRequest("Kyoto", "ryokan", 50)) == "over_budget"


@pytest.mark.parametrize(
    "args",
    [
        {"city": "Atlantis", "max_price": 100},
        {"city": 3, "max_price": 100},
        {"city": "Kyoto"},
        {"city": "Kyoto", "max_price": "100"},
        {"city": "Kyoto", "max_price": True},
        {"city": "Kyoto", "max_price": -5},
        {"city": "Kyoto", "max_price": 100, "kind": "castle"},
        {"city": "Kyoto", "max_price": 100, "amenities": ["pool"]},
        {"city": "Kyoto", "max_price": 100, "amenities": "onsen"},
        {"city": "Kyoto", "max_price": 100, "amenities": [["onsen"]]},
        {"city": "Kyoto", "max_price": 100, "amenities": [{}]},
        {"city": "Kyoto", "max_price": 100, "stars": 5},
    ],
)
def test_search_hotels_reports_bad_arguments(args: dict[str, object]) -> None:
    result = search_hotels(args, random.Random(0))
    assert result.startswith("Error: ") and "\n" not in result


def test_parse_tool_call_is_strict() -> None:
    good = '<tool_call>\n{"name": "search_hotels", "arguments": {"city": "Kyoto"}}\n</tool_call>'
    assert parse_tool_call(good) == ToolCall("search_hotels", {"city": "Kyoto"})
    assert parse_tool_call(f"  {good}\n") is not None
    for bad in (
        "",
        "Hotels in Kyoto - sorry, I found none.",
        f"Sure! {good}",
        good + good,
        '<tool_call>\n{"name": "search_hotels", "arguments": {"city": "Kyoto"}\n</tool_call>',
        '<tool_call>\n{"name": "search_hotels", "arguments": "{}"}\n</tool_call>',
        '<tool_call>\n{"name": "search_hotels", "arguments": {}, "x": 1}\n</tool_call>',
        '<tool_call>\n{"name": "search_hotels", "arguments": {}}',
    ):
        assert parse_tool_call(bad) is None, bad


def test_call_satisfies_grades_every_argument() -> None:
    request = HotelRequest("Kyoto", "ryokan", 200, ("free wifi", "onsen"))

    def call(**changes: object) -> ToolCall:
        args = {**tool_arguments(request), **changes}
        return ToolCall("search_hotels", {k: v for k, v in args.items() if v != "DROP"})

    assert call_satisfies(request, call())
    assert call_satisfies(request, call(city="京都"))
    assert call_satisfies(request, call(amenities=["onsen", "free wifi"]))
    assert not call_satisfies(request, ToolCall("find_hotels", tool_arguments(request)))
    assert not call_satisfies(request, call(city="Tokyo"))
    assert not call_satisfies(request, call(max_price=150))
    assert not call_satisfies(request, call(max_price=200.0))
    assert not call_satisfies(request, call(kind="hotel"))
    assert not call_satisfies(request, call(kind="DROP"))
    assert not call_satisfies(request, call(amenities=["onsen"]))
    assert not call_satisfies(request, call(amenities=["onsen", "onsen", "free wifi"]))
    assert not call_satisfies(request, call(stars=4))
    anywhere = HotelRequest("Paris", None, 100)
    assert call_satisfies(anywhere, ToolCall("search_hotels", {"city": "Paris", "max_price": 100}))
    assert call_satisfies(anywhere, ToolCall("search_hotels", tool_arguments(anywhere)))
    assert not call_satisfies(
        anywhere, ToolCall("search_hotels", {"city": "Paris", "max_price": 100, "kind": "hotel"})
    )


def test_rendered_reference_call_parses_and_satisfies_its_request() -> None:
    for p in sample_tool_eval_prompts(50, seed=0):
        text = render_conversation(p.messages + p.call_and_result, tools=p.tools)
        call_text = text.split("<|assistant|>\n")[-1].split("<|end|>")[0]
        call = parse_tool_call(call_text)
        assert call is not None and call_satisfies(p.request, call), call_text


def test_second_request_prompts_follow_a_whole_round() -> None:
    prompts = sample_tool_follow_up_prompts(100, seed=0)
    assert prompts == sample_tool_follow_up_prompts(100, seed=0)
    first_round = sample_tool_eval_prompts(100, seed=0)
    assert [p.messages for p in prompts] != [p.messages for p in first_round]  # own stream
    refinements = 0
    for p in prompts:
        roles = [m["role"] for m in p.messages if m["role"] != "system"]
        assert roles == ["user", "assistant", "tool", "assistant", "user"]
        assert [m["role"] for m in p.call_and_result] == ["assistant", "tool"]
        (call,) = p.call_and_result[0]["tool_calls"]
        assert call["function"]["arguments"] == tool_arguments(p.request)
        assert all(listing_matches(p.request, item) for item in p.listings)
        # A refinement ("Anything cheaper, under $100?") keeps the first call's city and
        # does not name it again.
        (first_call,) = next(m for m in p.messages if m.get("tool_calls"))["tool_calls"]
        names = (p.request.city, *CITY_BY_NAME[p.request.city].aliases)
        refinements += first_call["function"]["arguments"]["city"] == p.request.city and not any(
            name in p.messages[-1]["content"] for name in names
        )
    assert 0.3 < refinements / len(prompts) < 0.7  # half of them (_second_tool_round)


def test_tool_eval_prompts_are_deterministic_and_use_their_own_stream() -> None:
    prompts = sample_tool_eval_prompts(200, seed=0)
    assert prompts == sample_tool_eval_prompts(200, seed=0)
    assert prompts != sample_tool_eval_prompts(200, seed=1)
    assert [p.request for p in prompts] != [p.request for p in sample_eval_prompts(200, seed=0)]
    for p in prompts:
        assert p.messages[-1]["role"] == "user"
        assert [m["role"] for m in p.call_and_result] == ["assistant", "tool"]
        assert all(listing_matches(p.request, item) for item in p.listings)
        assert CITY_BY_NAME[p.request.city]
