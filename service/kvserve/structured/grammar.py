"""From ``StructuredOutputsParams`` to llguidance's grammar text (no compiling here).

The text is also the cache key of a compiled grammar: two requests with equal text share
one compile (``compiler.py``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

from kvserve.errors import InvalidRequestError
from kvserve.json_input import JSONInputError, parse_json
from kvserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

PARAM = "structured_outputs"
# The most characters of schema, regex, choices or grammar one request may send. A big
# grammar costs compile time (a 110 kB schema takes ~50 ms) and memory in the cache;
# OpenAI-style tool lists and response schemas stay far below this.
MAX_GRAMMAR_CHARS = 128 * 1024
# JSON as ``json.dumps`` writes it: ", " and ": " and no other whitespace. Flexible
# whitespace would let a model pad forever (a random-weight one does); a schema's own
# "x-guidance" options override these.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

# llguidance's parser limits, except that an error message does not quote parser state
# (it goes back to the client).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def error_text(message: str) -> str:
    """An llguidance error message as a client reads it: without the ``<non-verbose/>``
    line it appends when errors are not verbose (LIMITS)."""
    return message.replace("<non-verbose/>", "").strip()


KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


# The reasoning block a think_block constraint lets through first: free text up to the
# first "</think>" (a lazy match: the stop string ends it), then the constraint, which is
# the second grammar of the pair, referred to by name.
THINK_BLOCKS = {
    "optional": 'start: think? @answer\nthink: "<think>" thought\n',
    "open": "start: thought @answer\n",
}
THOUGHT = 'thought[stop="</think>"]: /(.|\\n)*/\n'


def grammar_of(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for ``params``; InvalidRequestError (param
    ``structured_outputs``) for a schema that is not a JSON object or for input over
    ``MAX_GRAMMAR_CHARS``. Cheap (no compile): whether the grammar compiles is
    ``validate``'s question."""
    answer = _answer_grammar(params)
    if params.think_block is None:
        return answer
    # grammar_from_lark gives Lark text; the others a TopLevelGrammar's JSON.
    answers = (
        json.loads(answer)["grammars"]
        if answer.lstrip().startswith("{")
        else [{"lark_grammar": answer}]
    )
    first = {"name": "reasoning", "lark_grammar": THINK_BLOCKS[params.think_block] + THOUGHT}
    return json.dumps({"grammars": [first, {**answers[0], "name": "answer"}, *answers[1:]]})


def _answer_grammar(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind == "json":
        schema = _schema_object(params.json)
        try:  # 1e999 reads as infinity, which llguidance would turn into null
            text = json.dumps(schema, allow_nan=False)
        except ValueError:
            raise InvalidRequestError(
                "the JSON schema has a number that is not finite (such as 1e999)", PARAM
            ) from None
        _check_size(len(text), "json schema")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:  # e.g. an integer beyond 64 bits
            raise InvalidRequestError(f"the JSON schema cannot be read: {exc}", PARAM) from None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_OPTIONS
        )
    if kind == "regex":
        assert params.regex is not None
        _check_size(len(params.regex), "regex")
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        assert params.choice is not None
        _check_size(sum(len(c) for c in params.choice), "choices")
        # Lark string literals take JSON's escapes, so json.dumps quotes any choice.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    assert params.grammar is not None
    _check_size(len(params.grammar), "grammar")
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


def _schema_object(schema: str | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(schema, str):
        _check_size(len(schema), "json schema")
        try:
            schema = parse_json(schema)
        except JSONInputError as exc:
            raise InvalidRequestError(f"structured_outputs.json: {exc}", PARAM) from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            f"a JSON schema must be a JSON object, got {type(schema).__name__}", PARAM
        )
    return schema


def _check_size(chars: int, what: str) -> None:
    if chars > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(
            f"the {what} has {chars} characters; at most {MAX_GRAMMAR_CHARS} are allowed",
            PARAM,
        )
