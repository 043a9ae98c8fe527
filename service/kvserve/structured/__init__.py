"""Structured outputs: a request's output constrained to a JSON schema, regex, choice or
grammar, with llguidance as the grammar engine (docs/engine.md, "Structured outputs").

``validate`` is the check every front end and the engine call; the engine compiles
grammars off its thread (``compiler.py``), follows each request with a matcher
(``matcher.py``) and masks the sampler's logits (``bitmask.py``).
"""

from __future__ import annotations

from kvserve.structured.grammar import MAX_GRAMMAR_CHARS, grammar_of
from kvserve.structured.validate import validate

__all__ = ["MAX_GRAMMAR_CHARS", "grammar_of", "validate"]
