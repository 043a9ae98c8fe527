"""Grammar compiles, off the engine thread, cached by the grammar's text."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from kvserve.errors import InvalidRequestError
from kvserve.structured.grammar import LIMITS, PARAM, error_text

COMPILE_THREADS = 2  # llguidance releases the GIL while it compiles
CACHE_SIZE = 256  # compiled grammars kept (least recently used goes first)


class CompiledGrammar:
    """A compiled grammar; each request follows it with a matcher of its own."""

    def __init__(self, prototype: llguidance.LLMatcher, vocab_size: int, seconds: float) -> None:
        self._prototype = prototype  # never consumes a token: only copied
        self.mask_words = (vocab_size + 31) // 32  # int32 words of one token mask
        self.seconds = seconds  # how long the cold compile took

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start (a copy: microseconds)."""
        return self._prototype.deep_copy()


class GrammarCompiler:
    """Compiles grammar text for one tokenizer in a small thread pool.

    Invariants: a grammar text is compiled at most once while it stays among the
    ``CACHE_SIZE`` most recently used (later requests share its future, done or not);
    ``compile`` never blocks the caller; a grammar that does not compile resolves its
    future with InvalidRequestError (param ``structured_outputs``), and that verdict is
    cached too. The tokenizer is built on the pool's first compile, so nothing is paid for
    it until a request needs a grammar.
    """

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer]) -> None:
        self._tokenizer = tokenizer
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self.num_compiles = 0
        self.num_cache_hits = 0
        # Called in the pool thread before each compile, with the grammar text: tests use
        # it to hold a compile until they release it.
        self.before_compile: Callable[[str], None] | None = None

    def compile(self, grammar: str) -> Future[CompiledGrammar]:
        with self._lock:
            future = self._cache.get(grammar)
            if future is not None:
                self._cache.move_to_end(grammar)
                self.num_cache_hits += 1
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    COMPILE_THREADS, thread_name_prefix="kvserve-grammar"
                )
            future = self._pool.submit(self._compile, grammar)
            self.num_compiles += 1
            self._cache[grammar] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _compile(self, grammar: str) -> CompiledGrammar:
        if self.before_compile is not None:
            self.before_compile(grammar)
        tokenizer = self._tokenizer()
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        seconds = time.perf_counter() - start
        if matcher.is_error():
            why = error_text(matcher.get_error())
            raise InvalidRequestError(
                f"the structured_outputs grammar does not compile: {why}", PARAM
            )
        # A grammar can compile and yet match no text at all (a regex of an empty character
        # class): its first mask fails. Found here, on a copy, it is the request's clear 400
        # before anything runs, not a failure at its first step.
        probe = matcher.deep_copy()
        probe.compute_logit_bias()
        if probe.is_error():
            raise InvalidRequestError(
                "the structured_outputs constraint matches no text: no token can begin it "
                f"(llguidance: {error_text(probe.get_error())})",
                PARAM,
            )
        return CompiledGrammar(matcher, tokenizer.vocab_size, seconds)

    def discard(self, compiled: Future[CompiledGrammar]) -> None:
        """Drop ``compiled`` from the cache: a request's matcher failed while it ran, and
        llguidance's copies share their lexer's state with it (a regex that grew past its
        limits left the prototype allowing only EOS), so the next request with the same
        text gets a fresh compile."""
        with self._lock:
            for text, future in list(self._cache.items()):
                if future is compiled:
                    del self._cache[text]

    def shutdown(self) -> None:
        """Stop the pool's threads (compiles not yet started are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
