"""Incremental (streaming) detokenization with stop-string handling.

Decoding works like vLLM's ``detokenize_incrementally``: two offsets into the output ids,
``prefix_offset <= read_offset``, delimit a small window. Each step decodes
``ids[prefix_offset:read_offset]`` (already emitted) and ``ids[prefix_offset:]`` and emits the
difference. Decoding a little context before the new tokens keeps tokenizer-specific behaviour
consistent with a full decode (e.g. SentencePiece's ``▁`` -> leading space, which a decoder strips
only at the very start of the text). Text that ends in U+FFFD is held back: it is (almost always)
an incomplete UTF-8 character whose remaining bytes are in tokens not generated yet. The windows
only span the tokens of the last emission plus the pending ones, so the cost per token is constant.

When ``skip_special_tokens`` is set, special token ids are dropped *before* windowing (a
full decode skips them too), so that a window never consists of special tokens only -- with the
Llama decoder that would make the next token lose its leading space.

Stop strings are matched on the decoded text, across token boundaries. Text that might be the
beginning of a stop string is held back until it is known not to be one, so a stop string never
leaks into the output. Once a stop string matches, the text is cut just before it (or just after
it with ``include_stop_str_in_output``) and the request must finish.

A stop match releases the text up to the stop string. On ``finished=True`` everything held back
is released, and the result is checked once against a full decode of the output; in the rare case
the two differ only in text not yet emitted, the full decode wins. If already-emitted text differs
(decoders that are not prefix-stable, e.g. a byte-fallback group that turns invalid after a valid
prefix was shown -- common with random-weight models -- or ``clean_up_tokenization_spaces``
rewriting across the window boundary) the streamed text is kept so that the deltas still
concatenate to ``text``, and a warning is logged (once per process).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvserve.stop_strings import StopMatcher

__all__ = ["IncrementalDetokenizer"]

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"

# Per-tokenizer cache of the ids that ``decode(..., skip_special_tokens=True)`` drops, keyed on the
# tokenizer object and validated by its length (adding tokens changes it).
_SPECIAL_IDS_CACHE: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, tuple[int, frozenset[int]]]
_SPECIAL_IDS_CACHE = weakref.WeakKeyDictionary()


def _compute_skipped_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # Fast tokenizers: the Rust decoder skips exactly the added tokens flagged special.
        decoder = backend.get_added_tokens_decoder()
        return frozenset(int(i) for i, tok in decoder.items() if getattr(tok, "special", False))
    return frozenset(int(i) for i in tokenizer.all_special_ids)


def _skipped_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    size = len(tokenizer)
    try:
        cached = _SPECIAL_IDS_CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable / hashable
        return _compute_skipped_ids(tokenizer)
    if cached is not None and cached[0] == size:
        return cached[1]
    ids = _compute_skipped_ids(tokenizer)
    with contextlib.suppress(TypeError):
        _SPECIAL_IDS_CACHE[tokenizer] = (size, ids)
    return ids


def _plain_backend(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The Rust tokenizer behind ``tokenizer`` when ``tokenizer.decode(ids, ...)`` is exactly
    its ``decode`` (a fast tokenizer that neither overrides decoding nor cleans up spaces),
    else None.

    Called on every token of every stream, transformers' wrapper (argument conversion,
    dispatch) costs several times the decode itself.
    """
    from transformers import PreTrainedTokenizerFast  # transformers 5: TokenizersBackend

    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and "decode" not in vars(tokenizer)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    ):
        return tokenizer.backend_tokenizer
    return None


_divergence_reported = False


def _report_divergence(msg: str, *args: object) -> None:
    """Warn the first time per process (random-weight models hit this constantly with
    byte-fallback tokenizers), then log at debug level."""
    global _divergence_reported
    if _divergence_reported:
        logger.debug(msg, *args)
    else:
        _divergence_reported = True
        logger.warning(msg + " (further occurrences are logged at debug level)", *args)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text deltas.

    After each :meth:`update`, :attr:`delta_text` is the newly visible text and :attr:`text` the
    whole visible text; the deltas always concatenate to :attr:`text`. Once finished, ``text`` is
    ``tokenizer.decode(token_ids, skip_special_tokens=...)`` cut before the matched stop string
    (or after it with ``include_stop_str_in_output``).
    """

    text: str
    delta_text: str
    token_ids: list[int]

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single string")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Empty stop strings would match everywhere; ignore them. Keep order, drop duplicates.
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        # Text decoded by the time the first min_tokens tokens are in is never searched
        # for stop strings (vLLM's min_tokens).
        self.min_tokens = min_tokens

        self.text = ""
        self.delta_text = ""
        self.token_ids = []
        #: The stop string that ended the output, if any.
        self.matched_stop: str | None = None

        self._backend = _plain_backend(tokenizer)
        self._skip_ids: frozenset[int] = (
            _skipped_ids(tokenizer) if skip_special_tokens else frozenset()
        )
        self._ids: list[int] = []  # ids that contribute to the text (special ones removed)
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text: str | None = None  # decode(self._ids[prefix:read]) cache
        self._decoded = ""  # all text decoded so far (visible text + held-back tail)
        self._stops = StopMatcher(self.stop)  # fed self._decoded; no stop string in it yet
        self._finished = False
        self._diverged = False  # emitted text is known to differ from a full decode
        self._hidden_stop_token = False  # the last token ended the output unshown (update)
        self._corrections = 0  # finish-time corrections applied (should stay 0 in practice)

    @property
    def finished(self) -> bool:
        """True once ``update(..., finished=True)`` was called or a stop string matched."""
        return self._finished

    # ------------------------------------------------------------------ decoding

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            text: str = self._backend.decode(
                list(ids), skip_special_tokens=self.skip_special_tokens
            )
            return text
        out = self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)
        return out if isinstance(out, str) else "".join(out)

    def _decode_step(self, flush: bool) -> str:
        """Decode the pending tokens; returns the text that became final."""
        ids = self._ids
        if self._read_offset >= len(ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        prefix_text = self._prefix_text
        new_text = self._decode(ids[self._prefix_offset :])
        if not flush and (
            len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)
        ):
            # Nothing new yet, or an incomplete UTF-8 character: wait for more tokens.
            return ""
        if not new_text.startswith(prefix_text):
            # The decoder is not prefix-stable for this window; the already emitted text cannot
            # be taken back. Keep the stream self-consistent (vLLM behaviour) and remember it.
            if not self._diverged:
                _report_divergence(
                    "incremental detokenization diverged from a full decode "
                    "(window %r -> %r); streamed text is kept",
                    prefix_text,
                    new_text,
                )
            self._diverged = True
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._prefix_text = None
        return delta

    # ------------------------------------------------------------------ stop strings

    def _find_stop(self) -> tuple[str, int, int] | None:
        """The first stop string to complete in the text decoded since the last call."""
        return self._stops.feed(self._decoded)

    def _held_back_len(self) -> int:
        """Length of the longest suffix of the decoded text that is a proper prefix of a stop."""
        if self.include_stop_str_in_output:
            # The stop string would be part of the output anyway; nothing needs hiding.
            return 0
        return self._stops.held_back()

    # ------------------------------------------------------------------ public API

    def update(
        self, new_token_ids: Sequence[int], finished: bool = False, stop_token: bool = False
    ) -> str | None:
        """Add newly generated tokens. Returns the stop string matched (the request must then
        finish with reason "stop"), or None. After the call, `delta_text` holds the newly
        visible text (possibly "") and `text` the whole visible text. ``stop_token``: the
        last of them is an EOS or stop token that ends the output; as in vLLM, its text is
        left out (it stays in ``token_ids``) unless ``include_stop_str_in_output``."""
        self.delta_text = ""
        self.token_ids.extend(new_token_ids)
        if self._finished:
            return None
        skip = self._skip_ids
        if stop_token and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
            self._hidden_stop_token = True
        self._ids.extend(t for t in new_token_ids if t not in skip)

        self._decoded += self._decode_step(flush=finished)
        if finished:
            self._correct_at_finish()

        visible_len = len(self.text)
        if self.stop and len(self.token_ids) <= self.min_tokens:
            self._stops.reset(fed=len(self._decoded))
        matched = self._find_stop() if self.stop else None
        if matched is not None:
            stop_str, start, end = matched
            visible_len = end if self.include_stop_str_in_output else start
            self.matched_stop = stop_str
            self._finished = True
        elif finished:
            visible_len = len(self._decoded)
            self._finished = True
        elif self.stop:
            visible_len = max(visible_len, len(self._decoded) - self._held_back_len())
        else:
            visible_len = len(self._decoded)

        if visible_len > len(self.text):
            self.delta_text = self._decoded[len(self.text) : visible_len]
            self.text = self._decoded[:visible_len]
        return self.matched_stop if matched is not None else None

    def _correct_at_finish(self) -> None:
        """One full decode at the end; adopt it where that does not contradict emitted text."""
        if self._diverged:
            return
        full = self._decode(self.token_ids[:-1] if self._hidden_stop_token else self.token_ids)
        if full == self._decoded:
            return
        if full.startswith(self.text):
            logger.debug("detokenizer finish correction: %r -> %r", self._decoded, full)
            self._corrections += 1
            # Re-scan for stop strings if already scanned text changed: from the start
            # (once, at the finish), since no stop string completed before the change.
            common = len(self.text)
            while (
                common < min(len(full), len(self._decoded))
                and full[common] == self._decoded[common]
            ):
                common += 1
            if common < self._stops.fed:
                self._stops.reset()
            self._decoded = full
        else:
            _report_divergence(
                "detokenized stream differs from the full decode; streamed text is kept "
                "(streamed %r, full %r)",
                self._decoded,
                full,
            )
            self._diverged = True
