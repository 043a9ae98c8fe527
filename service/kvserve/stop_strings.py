"""Finding stop strings in a growing text at a cost per character that does not grow
with the text, nor with the stop strings' lengths.

Each stop string keeps a Knuth–Morris–Pratt state: the length of the longest suffix of
the text so far that is a prefix of it. Feeding one character updates every state in
amortized constant time; a state that reaches its string's length is a match; and the
longest state is exactly how much of the text's tail could still become a stop string,
which the detokenizer holds back. The engine thread feeds each step's few new characters
once, where it used to compare every prefix of every stop string with the text's end at
every token (a request with long stop strings slowed every other request down).
"""

from __future__ import annotations

from collections.abc import Sequence


def _prefix_function(s: str) -> list[int]:
    """``fail[i]``: the longest proper prefix of ``s[: i + 1]`` that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Feed text in order; learn where the first stop string completes.

    ``stops`` are non-empty strings. ``feed`` returns the first match in the new text:
    the stop string that completes earliest, the longest one on a tie.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._fail = [_prefix_function(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self.fed = 0  # characters fed so far

    def reset(self, fed: int = 0) -> None:
        """Start over at ``fed``: the text before it counts as fed, never matched in."""
        self._state = [0] * len(self.stops)
        self.fed = fed

    def feed(self, text: str) -> tuple[str, int, int] | None:
        """Feed ``text[self.fed:]``; the first match as (stop, start, end) in ``text``.

        After a match, the characters after it are left unfed.
        """
        stops, fail, state = self.stops, self._fail, self._state
        for pos in range(self.fed, len(text)):
            c = text[pos]
            best = -1
            for j, s in enumerate(stops):
                k = state[j]
                if k == len(s):  # a full match earlier: continue from its border
                    k = fail[j][k - 1]
                while k and s[k] != c:
                    k = fail[j][k - 1]
                if s[k] == c:
                    k += 1
                state[j] = k
                if k == len(s) and (best < 0 or len(s) > len(stops[best])):
                    best = j
            if best >= 0:
                self.fed = pos + 1
                s = stops[best]
                return s, pos + 1 - len(s), pos + 1
        self.fed = len(text)
        return None

    def held_back(self) -> int:
        """How many of the fed text's last characters may still begin a stop string."""
        return max(self._state, default=0)
