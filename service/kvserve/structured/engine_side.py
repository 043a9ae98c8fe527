"""What one engine needs for structured outputs: its tokenizer's grammar view, a compiler
and a matcher per request."""

from __future__ import annotations

from typing import Any

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.grammar import grammar_of
from kvserve.structured.matcher import GrammarMatcher
from kvserve.structured.tokenizer import ll_tokenizer
from kvserve.structured.validate import check_grammar


class StructuredOutputs:
    """An engine's structured outputs.

    ``vocab_size`` is the width of the model's logits; ``eos_token_ids`` are the engine's
    EOS ids (a grammar may end with any of them). Built on the first constrained request.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self.compiler = GrammarCompiler(self.tokenizer)
        # The last params and their grammar: the n samples of one request share their
        # params object, and a large schema's text costs milliseconds to build each time.
        self._last: tuple[StructuredOutputsParams, str] | None = None

    def tokenizer(self) -> Any:
        """llguidance's tokenizer for this engine (built on first use, then cached)."""
        return ll_tokenizer(
            self._hf_tokenizer, vocab_size=self._vocab_size, eos_token_ids=self._eos_token_ids
        )

    def grammar(self, params: StructuredOutputsParams) -> str:
        """``params``' grammar text, checked for this engine's tokenizer
        (InvalidRequestError, as ``validate``). The verdict is cached by that tokenizer and
        the text, so a front end that checks a request off its event loop makes the
        engine's own check, in ``matcher``, a cache hit."""
        last = self._last
        if last is not None and last[0] is params:  # frozen: the same object, the same text
            return last[1]
        grammar = grammar_of(params)
        check_grammar(params, grammar, self.tokenizer())
        self._last = (params, grammar)
        return grammar

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """Check ``params`` and start its compile in the background; the matcher is ready
        when the compile is."""
        return GrammarMatcher(self.compiler.compile(self.grammar(params)))
