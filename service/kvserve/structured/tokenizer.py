"""llguidance's view of a Hugging Face tokenizer, built once per tokenizer object.

Building it reads the whole vocabulary (about a second for a 150k-token vocabulary, a few
milliseconds for the tests' tiny ones), so it is cached on the tokenizer object. The
engine builds it with its own EOS ids and vocabulary size (the logits' width); ``validate``
reuses whichever one exists, since checking a grammar depends on neither.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import llguidance
import llguidance.hf

_lock = threading.Lock()  # one build at a time: a second caller waits and reuses it
_built: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)


def ll_tokenizer(
    hf_tokenizer: Any,
    *,
    vocab_size: int | None = None,
    eos_token_ids: frozenset[int] | None = None,
) -> llguidance.LLTokenizer:
    """The LLTokenizer of ``hf_tokenizer`` (a fast Hugging Face tokenizer).

    With neither keyword, any one already built for this tokenizer (else one with the
    tokenizer's own EOS and size). ``vocab_size`` widens the vocabulary to the model's
    logits (padding ids are never allowed); ``eos_token_ids`` are the ids a grammar may
    end with.
    """
    with _lock:
        versions = _built.setdefault(hf_tokenizer, {})
        if vocab_size is None and eos_token_ids is None and versions:
            return next(iter(versions.values()))
        key = (vocab_size, tuple(sorted(eos_token_ids)) if eos_token_ids else None)
        if key not in versions:
            n_vocab = None
            if vocab_size is not None:
                n_vocab = max(vocab_size, len(hf_tokenizer))
            eos = sorted(eos_token_ids) if eos_token_ids else None
            try:
                versions[key] = llguidance.hf.from_tokenizer(
                    hf_tokenizer, n_vocab=n_vocab, eos_token=eos
                )
            except ValueError as exc:  # a slow (Python) tokenizer
                raise TypeError(f"structured outputs need a fast tokenizer: {exc}") from None
        return versions[key]
