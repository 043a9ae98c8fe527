"""llguidance's view of a Hugging Face tokenizer, built once per tokenizer object.

Building it reads the whole vocabulary (about a second for a 150k-token vocabulary, a few
milliseconds for the tests' tiny ones), so it is cached on the tokenizer object. The
engine builds it with its own EOS ids and vocabulary size (the logits' width); ``validate``
reuses whichever one exists, since checking a grammar depends on neither.

Added tokens that are not special (Qwen's ``<tool_call>`` and ``<think>``, the demo
model's ``<tool_call>``) are text: the tokenizer makes them from their text, and decoding
keeps them. llguidance's own loader makes every added token special, so a grammar's
literal ``"<tool_call>"`` never matched the model's token for it (a model was made to
spell it out), and where the literal was forced, the mask offered the token and the
matcher then refused it, failing the request. The same happened to forced text that
spells a special token (``"<|end|>"``), which the loader tokenized as that token. So the
view is rebuilt with such tokens as text, and forced text tokenized as plain text
(``_TextView``).
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any

import llguidance
import llguidance.hf
from llguidance import TokenizerWrapper

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
                built = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos)
            except ValueError as exc:  # a slow (Python) tokenizer
                raise TypeError(f"structured outputs need a fast tokenizer: {exc}") from None
            view = _TextView(hf_tokenizer, built)
            versions[key] = llguidance.LLTokenizer(
                TokenizerWrapper(view), n_vocab=n_vocab, eos_token=eos
            )
        return versions[key]


class _TextView:
    """What ``llguidance.TokenizerWrapper`` reads: each token's bytes as llguidance's loader
    decoded them; as special, only the ids the tokenizer calls special; and a tokenizer
    for forced text that spells out what looks like a special token (as the model must:
    the matcher takes a special token only where the grammar names it) and makes an added
    text token from its text."""

    def __init__(self, hf_tokenizer: Any, loaded: llguidance.LLTokenizer) -> None:
        n = len(hf_tokenizer)
        added = getattr(hf_tokenizer, "added_tokens_decoder", {})
        text_ids = {i for i, token in added.items() if not token.special}
        self.tokens = [loaded.decode_bytes([i]) for i in range(n)]
        self.special_token_ids = [
            i for i in range(n) if loaded.is_special_token(i) and i not in text_ids
        ]
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id
        self._backend = copy.copy(hf_tokenizer.backend_tokenizer)
        self._backend.encode_special_tokens = True

    def __call__(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)
