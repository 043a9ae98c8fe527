"""Where one request is in its grammar."""

from __future__ import annotations

from concurrent.futures import Future

import llguidance

from kvserve.structured.compiler import CompiledGrammar
from kvserve.structured.grammar import error_text

# A grammar whose token masks take more than this much CPU (llguidance's, on the
# engine's thread) this many times fails its request: an ordinary JSON schema's mask
# takes well under a millisecond; a pattern such as ^a{100000}$ took ~45 ms on the
# 2-core dev host with the demo model's 1,388-token vocabulary, every step.
MAX_MASK_CPU_SECONDS = 0.02
MAX_COSTLY_MASKS = 2


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
        self.costly_masks = 0  # masks over MAX_MASK_CPU_SECONDS (TokenMasker counts them)
        self._too_costly: str | None = None  # why it is in error, if for its cost

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
        accepted EOS would end the request as if the grammar were complete), or its masks
        cost too much (``mask_cost``)."""
        if self._too_costly is not None:
            return False
        return self.matcher.consume_token(token_id) and not self.matcher.is_error()

    def mask_cost(self, seconds: float) -> None:
        """A mask of this grammar took ``seconds`` of CPU. The masks are filled on the
        engine's thread, so each one delays every request of the step: the
        ``MAX_COSTLY_MASKS``-th over ``MAX_MASK_CPU_SECONDS`` puts the grammar in error,
        and its request fails at its next token."""
        if seconds <= MAX_MASK_CPU_SECONDS:
            return
        self.costly_masks += 1
        if self.costly_masks >= MAX_COSTLY_MASKS and self._too_costly is None:
            self._too_costly = (
                f"the constraint costs too much to enforce: a token mask took "
                f"{seconds * 1000:.0f} ms of CPU (limit {MAX_MASK_CPU_SECONDS * 1000:.0f} ms, "
                "which every request of the batch waits for); simplify it (a large exact "
                "repetition such as a{100000} does this)"
            )

    @property
    def finished(self) -> bool:
        """No token but EOS can follow: the output is complete."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        if self._too_costly is not None:
            return self._too_costly
        return error_text(self.matcher.get_error())
