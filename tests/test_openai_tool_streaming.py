"""Tool calls as deltas (openai/tool_streaming.py): argument by argument when a grammar
forces the calls, whole otherwise; streamed and whole answers agree; a call marker that
is a special token is put back by its token id."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.openai import format as fmt
from kvserve.openai.chat_output import ChatDelta, ChatOutputParser, ChatParsing, delta_chunks
from kvserve.openai.tool_streaming import CallJson
from kvserve.openai.tools import ChatTools, ToolChoice, ToolSpec
from kvserve.testing.tokenizers import (
    BYTE_LEVEL_MISTRAL_TOOLS_CHAT_TEMPLATE,
    MISTRAL_TOOL_MARKER,
    build_byte_level_tokenizer,
)

OBJECT: dict[str, Any] = {"type": "object"}
TOOLS = (ToolSpec("get_weather", None, OBJECT), ToolSpec("add", None, OBJECT))
REQUIRED = ChatTools(TOOLS, ToolChoice("required"))
AUTO = ChatTools(TOOLS, ToolChoice("auto"))  # no strict tool: no grammar
AUTO_STRICT = ChatTools((TOOLS[0], ToolSpec("add", None, OBJECT, strict=True)), ToolChoice("auto"))

# Two calls each, as the formats' grammars write them (openai/tool_grammar.py), with
# spellings json.dumps would not use (escapes, 1E2, 2.50) that the answer re-spells.
ARGS_1 = '{"city": "Paris \\u00e9\\/\\ud83d\\ude00", "days": [1E2, 2.50, -0], "x": {"ok": true}}'
ARGS_2 = '{"a": 1, "b": null}'
FORCED = {
    "hermes": f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS_1}}}\n</tool_call>\n'
    f'<tool_call>\n{{"name": "add", "arguments": {ARGS_2}}}\n</tool_call>',
    "llama3_json": f'{{"name": "get_weather", "parameters": {ARGS_1}}}; '
    f'{{"name": "add", "parameters": {ARGS_2}}}',
    "mistral": f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS_1}}}, '
    f'{{"name": "add", "arguments": {ARGS_2}}}]',
}
WHOLE_CALLS = [
    ("get_weather", json.dumps(json.loads(ARGS_1), ensure_ascii=False)),
    ("add", json.dumps(json.loads(ARGS_2), ensure_ascii=False)),
]


def reader(parser: str, tools: ChatTools) -> ChatOutputParser:
    out = ChatParsing(parser).parser(tools)
    assert out is not None
    return out


def steps(parser: ChatOutputParser, chunks: list[str], end: str = "stop") -> list[ChatDelta]:
    out = []
    for i, chunk in enumerate(chunks):
        delta, finish = parser.step(chunk, end if i == len(chunks) - 1 else None)
        out.append(delta)
    assert finish == (("tool_calls" if parser.num_calls else "stop") if end == "stop" else end)
    return out


def joined(deltas: list[ChatDelta]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) of the calls, as a client puts the stream together."""
    whole = ChatDelta()
    for d in deltas:
        whole = whole.extend(d)
    calls = fmt.joined_calls(whole.tool_calls)
    return whole.content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("parser", list(FORCED))
def test_forced_calls_stream_argument_by_argument(parser: str) -> None:
    text = FORCED[parser]
    deltas = steps(reader(parser, REQUIRED), list(text))  # one character per step
    pieces = [c for d in deltas for c in d.tool_calls]
    for index, (name, arguments) in enumerate(WHOLE_CALLS):
        mine = [p for p in pieces if p.index == index]
        assert mine[0].id and mine[0].id.startswith("call_") and mine[0].name == name
        assert mine[0].arguments == ""  # the header comes as soon as the name is read
        assert all(p.id is None and p.name is None for p in mine[1:])
        assert len(mine) > 10  # the arguments came piece by piece
        assert "".join(p.arguments for p in mine) == arguments
    # The indexes go up: every piece of call 0 comes before call 1's header.
    assert [p.index for p in pieces] == sorted(p.index for p in pieces)
    # The whole answer (one step) is the same, and what the whole-call parser reads.
    whole = joined(steps(reader(parser, REQUIRED), [text]))
    assert joined(deltas) == whole == ("", WHOLE_CALLS)
    assert joined(steps(reader(parser, AUTO), [text])) == whole


@pytest.mark.parametrize("parser", list(FORCED))
def test_forced_streamed_and_whole_agree_for_any_cuts(parser: str) -> None:
    text = FORCED[parser]
    rng = random.Random(0)
    whole = joined(steps(reader(parser, REQUIRED), [text]))
    for _ in range(40):
        points = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, 30)))
        chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
        assert joined(steps(reader(parser, REQUIRED), chunks)) == whole


def test_the_first_streamed_chunk_of_a_call_is_openais_header() -> None:
    ids = {"id": "chatcmpl-1", "created": 0, "model": "m"}
    parser = reader("hermes", REQUIRED)
    text = FORCED["hermes"]
    chunks = []
    for i, char in enumerate(text):
        delta, finish = parser.step(char, "stop" if i == len(text) - 1 else None)
        chunks += delta_chunks(ids, delta, None, finish, not chunks)
    calls = [c["choices"][0]["delta"].get("tool_calls") for c in chunks]
    first = next(c for c in calls if c)[0]
    assert first["index"] == 0 and first["id"].startswith("call_")
    assert first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    later = [c[0] for c in calls if c and "id" not in c[0]]
    assert later and all(set(c) == {"index", "function"} for c in later)
    assert set(later[-1]["function"]) == {"arguments"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    headers = [c[0]["index"] for c in calls if c and "id" in c[0]]
    assert headers == [0, 1]


@pytest.mark.parametrize("parser", list(FORCED))
def test_without_a_grammar_a_call_is_sent_only_once_it_parses(parser: str) -> None:
    text = FORCED[parser]
    deltas = steps(reader(parser, AUTO), list(text))
    pieces = [c for d in deltas for c in d.tool_calls]
    # Whole calls: one piece each, header and all the arguments.
    assert [(p.name, p.arguments) for p in pieces] == WHOLE_CALLS
    # Cut short, or broken: text, never a call (however it is cut).
    unknown = text.replace('"add"', '"subtract"').replace('"get_weather"', '"get_moon"')
    for broken in (text[: len(text) // 2], unknown):
        content, calls = joined(steps(reader(parser, AUTO), list(broken)))
        assert calls == [] and "".join(content.split()) == "".join(broken.split())


def test_a_forced_call_cut_short_keeps_what_was_sent() -> None:
    text = FORCED["hermes"][:60]  # max_tokens ends it inside the first call's arguments
    deltas = steps(reader("hermes", REQUIRED), list(text), end="length")
    content, calls = joined(deltas)
    assert content == "" and len(calls) == 1
    assert calls[0][0] == "get_weather" and WHOLE_CALLS[0][1].startswith(calls[0][1])
    assert joined(steps(reader("hermes", REQUIRED), [text], end="length")) == (content, calls)
    # Cut before its name was read: the call's text is content.
    deltas = steps(reader("hermes", REQUIRED), ['<tool_call>\n{"na'], end="length")
    assert joined(deltas) == ('<tool_call>\n{"na', [])


@pytest.mark.parametrize(
    "arguments",
    [
        '{"a": 15',  # a number being read
        '{"a": -1.5e',
        '{"a": 1, "b": nu',  # a literal
        '{"a": tr',
        '{"city": "Paris \\u00',  # an escape
        '{"city": "Paris \\',
        '{"city": "\\ud83d',  # a high surrogate waiting for its low half
        '{"city": "\\ud83d\\ude',
    ],
)
def test_a_forced_call_cut_inside_a_token_keeps_its_characters(arguments: str) -> None:
    """max_tokens may end the output inside a number, a literal or an escape: those
    characters were generated, so the call's arguments end with them too."""
    text = f'<tool_call>\n{{"name": "add", "arguments": {arguments}'
    for chunks in (list(text), [text]):
        content, calls = joined(steps(reader("hermes", REQUIRED), chunks, end="length"))
        assert (content, calls) == ("", [("add", arguments)])


@pytest.mark.parametrize("text", ["Hello <tool_call>\n{}", "Plain text, no call."])
def test_text_under_auto_with_a_strict_tool_is_read_as_without_a_grammar(text: str) -> None:
    """In "auto" the grammar lets text come instead of calls (and then constrains
    nothing): it is read by the whole-call parser."""
    got = joined(steps(reader("hermes", AUTO_STRICT), list(text)))
    content, calls = joined(steps(reader("hermes", AUTO), [text]))
    assert (
        got == (content, calls)
        and calls == []
        and "".join(content.split()) == "".join(text.split())
    )


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    # Any character, escaped or not, lone surrogates included (json keeps those).
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.text(), JSON, max_size=5),
    st.booleans(),
    st.sampled_from([None, 0, 2]),
    st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]),
)
def test_arguments_are_spelled_as_json_dumps_spells_them(
    args: dict[str, Any], ascii_only: bool, indent: int | None, separators: tuple[str, str]
) -> None:
    spelled = json.dumps(args, ensure_ascii=ascii_only, indent=indent, separators=separators)
    call = CallJson()
    for char in f'{{"name": "f", "arguments": {spelled}}}':
        call.feed(char)
    assert call.done and call.name == "f"
    assert "".join(call.arguments) == json.dumps(args, ensure_ascii=False)


def test_odd_spellings_are_spelled_as_json_dumps_spells_them() -> None:
    for spelled in [
        '{"n": [1E2, 1e-2, -0, 2.50, 10, -1.0E+3]}',
        '{"s": "\\ud83d\\ude00 \\ud800 \\ud800\\n \\udc00 \\/ \\u001f \\u2028"}',
        '{ "a" : { } , "b" : [ ] , "c" : [ true , false , null ] }',
    ]:
        call = CallJson()
        call.feed(f'{{"name": "f", "arguments": {spelled}}}')
        assert "".join(call.arguments) == json.dumps(json.loads(spelled), ensure_ascii=False)


# ---- a marker that is a special token --------------------------------------------------
def test_a_special_marker_token_is_put_back_where_it_was() -> None:
    """Mistral's [TOOL_CALLS] is a special token there: the answer's text (decoded with
    skip_special_tokens, as the engine does) leaves it out; the reader is given each
    step's token ids and reads the calls all the same."""
    tok = build_byte_level_tokenizer(
        chat_template=BYTE_LEVEL_MISTRAL_TOOLS_CHAT_TEMPLATE, extra_special=(MISTRAL_TOOL_MARKER,)
    )
    parsing = ChatParsing.for_model(None, None, tok.chat_template, tok)
    marker = tok.convert_tokens_to_ids(MISTRAL_TOOL_MARKER)
    assert parsing.tool_parser == "mistral" and parsing.special_markers == {marker: "[TOOL_CALLS]"}
    calls = FORCED["mistral"].removeprefix(MISTRAL_TOOL_MARKER)
    rng = random.Random(3)
    for tools, prefix in ((REQUIRED, ""), (AUTO, "Sure. ")):
        ids = [*tok.encode(prefix, add_special_tokens=False), marker]
        ids += tok.encode(calls, add_special_tokens=False)
        # One token per step, then steps taken together (a reader that fell behind).
        for size in (1, 2, 5, 30):
            cuts = sorted(rng.sample(range(1, len(ids)), k=(len(ids) - 1) // size))
            groups = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
            detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
            parser = parsing.parser(tools)
            assert parser is not None
            deltas = []
            for i, group in enumerate(groups):
                last = i == len(groups) - 1
                text = ""
                for j, token in enumerate(group):
                    detok.update([token], finished=last and j == len(group) - 1)
                    text += detok.delta_text
                delta, _ = parser.step(text, "stop" if last else None, group)
                deltas.append(delta)
            assert MISTRAL_TOOL_MARKER not in detok.text  # the text has no marker
            assert joined(deltas) == (prefix.strip(), WHOLE_CALLS), (size, groups)


@pytest.mark.parametrize("parser", list(FORCED))
def test_a_call_cut_by_a_stop_string_finishes_stop_not_tool_calls(parser: str) -> None:
    """Its arguments are not whole JSON: "tool_calls" would tell an agent to run it. A
    stop string after complete calls still finishes "tool_calls"."""
    text = FORCED[parser]
    cut = text[: text.index('"days"')]  # inside the first call's arguments
    cut_reader = reader(parser, REQUIRED)
    _, finish = cut_reader.step(cut, "stop", (), '"days"')
    assert cut_reader.num_calls == 1 and finish == "stop"
    whole_reader = reader(parser, REQUIRED)
    _, finish = whole_reader.step(text, "stop", (), "\nThe end")
    assert whole_reader.num_calls == 2 and finish == "tool_calls"
