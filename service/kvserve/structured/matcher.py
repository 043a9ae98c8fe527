"""Where one request is in its grammar."""

from __future__ import annotations

from concurrent.futures import Future

import llguidance

from kvserve.structured.compiler import CompiledGrammar
from kvserve.structured.grammar import error_text


class GrammarMatcher:
    """One request's grammar state: its compile, then its llguidance matcher.

    Invariant: once ``start()``ed, the matcher has consumed exactly the request's output
    tokens, in order, so the next mask is the one for the request's next token. The
    engine samples a request only after its last output token was consumed, and
    preemption keeps a request's output tokens (it recomputes their KV), so nothing ever
    rolls back.
    """

    def __init__(self, compiled: Future[CompiledGrammar]) -> None:
        self.compiled = compiled
        self._matcher: llguidance.LLMatcher | None = None
        self.mask_words = 0

    @property
    def ready(self) -> bool:
        """The compile is over (well or not): ``start()`` will not block."""
        return self.compiled.done()

    def start(self) -> None:
        """Take a fresh matcher; raises what the compile raised (InvalidRequestError)."""
        compiled = self.compiled.result()
        self._matcher = compiled.matcher()
        self.mask_words = compiled.mask_words

    @property
    def matcher(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            raise RuntimeError("the grammar matcher was not started")
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Consume a sampled token; False (see ``error``) if the grammar refuses it, or is
        in error (past a limit while computing the mask, which then allows only EOS: an
        accepted EOS would end the request as if the grammar were complete)."""
        return self.matcher.consume_token(token_id) and not self.matcher.is_error()

    @property
    def finished(self) -> bool:
        """No token but EOS can follow: the output is complete."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return error_text(self.matcher.get_error())
