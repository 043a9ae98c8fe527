"""The grammar that forces a request's tool calls into its parser's format.

Used when ``tool_choice`` is "required" or names a function, or a tool is ``strict``
(``ChatTools.constrained``): the output is then constrained from its first token, so a
call always parses and its arguments validate against the tool's schema, whatever the
weights. The grammar is Lark text in llguidance's syntax, each call's JSON an embedded
``%json`` schema; it travels as ``StructuredOutputsParams(grammar=...)``.

Per format (``openai/tool_parsers.py``):

* hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one call or,
  with ``parallel_tool_calls`` (and no named function), several separated by a newline;
* llama3_json: ``{"name": ..., "parameters": {...}}``, several separated by ``; ``;
* mistral: ``[TOOL_CALLS]`` then a JSON list of calls (one item unless parallel).

With ``tool_choice`` "auto" (a strict tool offered), the output may instead be plain
text, which must not begin like a call.

A marker that the tokenizer makes a special token (``special_markers``, e.g. Mistral's
``[TOOL_CALLS]``) is that token in the grammar (``<[id]>``): a literal would force the
model to spell it in plain tokens, which it was not trained to do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvserve.openai.tools import ChatTools, ToolSpec

ANY_OBJECT: dict[str, Any] = {"type": "object"}
NL = "\n"
# llguidance's JSON options: one space after ":" and ",", none elsewhere. A call's JSON
# then has one spelling, and a model cannot spend its tokens on whitespace.
COMPACT_JSON: dict[str, Any] = {
    "whitespace_flexible": False,
    "key_separator": ": ",
    "item_separator": ", ",
}


def tool_call_grammar(
    parser: str, tools: ChatTools, special_markers: Mapping[int, str] | None = None
) -> str:
    """Lark text (llguidance syntax) for the calls ``tools`` allows, in ``parser``'s format.
    ``special_markers``: the format's markers that are special tokens (id: text)."""
    ids = {text: i for i, text in (special_markers or {}).items()}

    def literal(*parts: str) -> str:
        """``parts`` in a row: plain text as one literal, a special marker as its token."""
        out, plain = [], ""
        for part in parts:
            if part in ids:
                out += [json.dumps(plain)] if plain else []
                out.append(f"<[{ids[part]}]>")
                plain = ""
            else:
                plain += part
        return " ".join(out + ([json.dumps(plain)] if plain else []))

    choice = tools.choice
    offered = [t for t in tools.tools if choice.mode != "function" or t.name == choice.function]
    # In "auto", only strict tools promise schema-valid arguments; the others are held to
    # a JSON object (the parser needs no more).
    exact = choice.mode != "auto"
    # A named function is called once; otherwise as many times as parallel_tool_calls lets.
    parallel = tools.parallel and choice.mode != "function"
    if parser == "mistral":
        calls = _mistral(offered, exact, parallel, literal("[TOOL_CALLS]"))
        text = r"/[^\[][\s\S]*/"
    else:
        args_key = "parameters" if parser == "llama3_json" else "arguments"
        functions = [_call_schema(t, args_key, exact, i) for i, t in enumerate(offered)]
        alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
        if parser == "hermes":
            one = f"call: {literal('<tool_call>', NL)} fn {literal(NL, '</tool_call>')}"
            sep = '"\\n"'
            text = r"/[^<][\s\S]*/"
        else:
            one = "call: fn"
            sep = '"; "'
            text = r"/[^{<\s][\s\S]*/"
        rules = [f"calls: call ({sep} call)*" if parallel else "calls: call", one]
        rules.append(f"fn: {alternatives}")
        rules += [f"fn_{i}: %json {json.dumps(s)}" for i, s in enumerate(functions)]
        calls = "\n".join(rules)
    start = "start: calls | TEXT" if choice.mode == "auto" else "start: calls"
    lines = [start, calls]
    if choice.mode == "auto":
        lines.append(f"TEXT: {text}")
    return "\n".join(lines) + "\n"


def _arguments_schema(tool: ToolSpec, exact: bool) -> dict[str, Any]:
    return tool.parameters if exact or tool.strict else ANY_OBJECT


def _call_schema(tool: ToolSpec, args_key: str, exact: bool, index: int) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``. Its arguments' schema is nested inside the
    call's, so a ``$ref`` of it ("#/$defs/Budget", as pydantic and the OpenAI SDK write
    them) would resolve against the call's root: such a schema moves to the root's
    ``$defs`` under ``tool_{index}`` and its references are rewritten to point there."""
    arguments = _arguments_schema(tool, exact)
    defs: dict[str, Any] = {}
    name = f"tool_{index}"
    rebased = _rebase_refs(arguments, f"#/$defs/{name}")
    if rebased != arguments:  # it has a document-local reference
        defs[name] = rebased
        arguments = {"$ref": f"#/$defs/{name}"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: arguments},
        "required": ["name", args_key],
        "additionalProperties": False,
        "x-guidance": COMPACT_JSON,
    } | ({"$defs": defs} if defs else {})


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas: there a key is a name ("default" may name a
# property), never a keyword, and every value is a schema.
SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _rebase_refs(schema: Any, base: str, names: bool = False) -> Any:
    """``schema`` with every document-local ``$ref`` ("#..." ) made relative to ``base``
    (``names``: ``schema`` is a map of names to schemas, the value of a SCHEMA_MAPS
    keyword)."""
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    if names:
        return {k: _rebase_refs(v, base) for k, v in schema.items()}
    out = {
        k: v if k in DATA_KEYWORDS else _rebase_refs(v, base, k in SCHEMA_MAPS)
        for k, v in schema.items()
    }
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def _mistral(offered: list[ToolSpec], exact: bool, parallel: bool, marker: str) -> str:
    items = [_call_schema(t, "arguments", exact, i) for i, t in enumerate(offered)]
    defs: dict[str, Any] = {}
    for item in items:
        del item["x-guidance"]  # the array's own applies to the whole
        defs |= item.pop("$defs", {})  # one document: its references go from its root
    array: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
        "x-guidance": COMPACT_JSON,
    } | ({"$defs": defs} if defs else {})
    if not parallel:
        array["maxItems"] = 1
    return f"calls: {marker} %json {json.dumps(array)}"
