"""Check a structured-outputs constraint before a request is accepted."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import llguidance

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.grammar import KIND_NAMES, LIMITS, PARAM, error_text, grammar_of
from kvserve.structured.tokenizer import ll_tokenizer

CACHE_SIZE = 1024  # verdicts kept, by grammar text

_lock = threading.Lock()
# (tokenizer, grammar text) → "" or the error. Keyed by the tokenizer object itself (it
# hashes by identity), so a verdict never outlives the tokenizer it was made for.
_verdicts: OrderedDict[tuple[llguidance.LLTokenizer | None, str], str] = OrderedDict()


def validate(params: StructuredOutputsParams, tokenizer: Any) -> None:
    """Raise InvalidRequestError (param ``structured_outputs``) if ``params`` cannot be
    compiled for ``tokenizer`` (a fast Hugging Face tokenizer, or None to check without
    one: then special tokens a grammar names are not checked).

    The message says why: invalid JSON, an invalid schema or one with a keyword
    llguidance does not support, a regex or grammar that does not compile, or input over
    ``MAX_GRAMMAR_CHARS``. Front ends re-raise it with their own ``param``.

    Cost: the verdict is cached by the grammar's text, so a repeated constraint costs
    microseconds. A new one costs llguidance's grammar check: well under a millisecond
    for a typical schema, up to ~50 ms for one near the size limit; and the first call
    for a tokenizer builds llguidance's tokenizer (~1 s for a 150k vocabulary). A caller on
    an event loop should run it in a thread for a large or never-seen constraint.
    Thread-safe.
    """
    lltok = ll_tokenizer(tokenizer) if tokenizer is not None else None
    check_grammar(params, grammar_of(params), lltok)


def check_grammar(
    params: StructuredOutputsParams, grammar: str, tokenizer: llguidance.LLTokenizer | None
) -> None:
    """``validate`` for a grammar already made by ``grammar_of(params)``."""
    key = (tokenizer, grammar)
    with _lock:
        verdict = _verdicts.get(key)
        if verdict is not None:
            _verdicts.move_to_end(key)
    if verdict is None:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, tokenizer, limits=LIMITS
        )
        verdict = messages[0] if is_error and messages else ""
        with _lock:
            _verdicts[key] = verdict
            while len(_verdicts) > CACHE_SIZE:
                _verdicts.popitem(last=False)
    if verdict:
        raise InvalidRequestError(_explain(params, error_text(verdict)), PARAM)


def _explain(params: StructuredOutputsParams, verdict: str) -> str:
    unimplemented = "Unimplemented keys:"
    if verdict.startswith(unimplemented):
        keys = verdict.removeprefix(unimplemented).strip()
        return f"the JSON schema uses keywords that structured outputs do not support: {keys}"
    return f"invalid structured_outputs {KIND_NAMES[params.kind]}: {verdict}"
