"""The stop-string matcher against a plain reference, on random texts fed in chunks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.stop_strings import StopMatcher

ALPHABET = "ab"  # two letters: overlaps and repeated prefixes are the common case


def reference_match(text: str, stops: list[str]) -> tuple[str, int, int] | None:
    """The stop that completes earliest, the longest on a tie."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
            best = (i + len(s), -len(s), s)
    return None if best is None else (best[2], best[0] + best[1], best[0])


def reference_held_back(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_matches_the_reference_however_the_text_arrives(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    matcher = StopMatcher(stops)
    found = None
    for end in [*sorted(c for c in cuts if c <= len(text)), len(text)]:
        found = matcher.feed(text[:end])
        if found is not None:
            break
        assert matcher.held_back() == reference_held_back(text[:end], stops)
    assert found == reference_match(text, stops)


def test_a_long_stop_string_that_the_text_keeps_almost_matching() -> None:
    # One 2,000-character stop string of one letter against a text of that letter: the
    # held-back length grows to 1,999 and never needs a rescan of the string.
    matcher = StopMatcher(["a" * 2000])
    text = ""
    for _ in range(1999):
        text += "a"
        assert matcher.feed(text) is None
    assert matcher.held_back() == 1999
    assert matcher.feed(text + "a") == ("a" * 2000, 0, 2000)
