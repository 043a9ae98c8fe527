"""The readers of chat answers (openai/tool_parsers.py, reasoning.py, chat_output.py) and
the tool-call grammars (openai/tool_grammar.py): cut-invariance, malformed calls as text,
``</think>`` across chunks, grammars that llguidance accepts."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import llguidance
import pytest

from kvserve.openai import format as fmt
from kvserve.openai.chat_output import ChatDelta, ChatOutputParser, ChatParsing
from kvserve.openai.reasoning import ReasoningParser
from kvserve.openai.tool_grammar import tool_call_grammar
from kvserve.openai.tool_parsers import detect_tool_parser, make_tool_parser
from kvserve.openai.tools import ChatTools, ToolChoice, ToolSpec

NAMES = frozenset({"get_weather", "add"})
WEATHER = ToolSpec(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
ADD = ToolSpec(
    "add",
    None,
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    strict=True,
)
# "auto" without a strict tool: no grammar, so the text may hold anything.
UNCONSTRAINED = ChatTools((WEATHER, replace(ADD, strict=False)), ToolChoice("auto"))


def run(parser: ChatOutputParser, chunks: list[str]) -> ChatDelta:
    whole = ChatDelta()
    for i, chunk in enumerate(chunks):
        delta, _ = parser.step(chunk, "stop" if i == len(chunks) - 1 else None)
        whole = whole.extend(delta)
    return whole


def cuts(text: str, rng: random.Random) -> list[str]:
    """``text`` cut at random places (single characters included)."""
    points = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def answer(
    parser: str | None,
    reasoning: str | None,
    chunks: list[str],
    tools: ChatTools = UNCONSTRAINED,
) -> ChatDelta:
    reader = ChatParsing(parser, reasoning).parser(tools)
    assert reader is not None
    return run(reader, chunks)


def without_ids(delta: ChatDelta) -> tuple[str, str, list[tuple[int, str, str]]]:
    """The answer as a whole (its call deltas joined), call ids left out."""
    calls = fmt.joined_calls(delta.tool_calls)
    return (
        delta.content,
        delta.reasoning,
        [(i, c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(calls)],
    )


OUTPUTS = {
    "hermes": [
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        "Plain answer < with a less-than and <tool but no call.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> after',
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}',  # cut by max_tokens
        # Text before a malformed or unfinished call keeps its whitespace.
        'Sure.\n\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
        'Sure. \n<tool_call>\n{"name": "add", "arguments": ',
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "add", '
        '"parameters": {"a": 1, "b": 2}}',
        '<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}',
        "The answer is {not json}",
        '{"name": "get_weather", "parameters": {"city": ',
    ],
    "mistral": [
        'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 5, "b": 6}}]',
        "No calls [TOOL here.",
        "[TOOL_CALLS] not a list",
    ],
}


@pytest.mark.parametrize("parser", list(OUTPUTS))
def test_streaming_and_whole_agree_for_any_cuts(parser: str) -> None:
    rng = random.Random(0)
    for text in OUTPUTS[parser]:
        whole = without_ids(answer(parser, None, [text]))
        for _ in range(50):
            assert without_ids(answer(parser, None, cuts(text, rng))) == whole, text


def test_hermes_calls_and_content() -> None:
    calls = answer("hermes", None, [OUTPUTS["hermes"][0]])
    assert calls.content == "Let me check."
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls.tool_calls] == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "add", {"a": 1, "b": 2}),
    ]
    assert all(c.id and c.id.startswith("call_") for c in calls.tool_calls)
    for text in OUTPUTS["hermes"][1:]:  # never a malformed call: the text is content
        out = answer("hermes", None, [text])
        assert out.tool_calls == [] and out.content == text


def test_llama3_json_and_mistral() -> None:
    out = answer("llama3_json", None, [OUTPUTS["llama3_json"][0]])
    assert [c.name for c in out.tool_calls] == ["get_weather", "add"] and out.content == ""
    for text in OUTPUTS["llama3_json"][2:]:
        assert answer("llama3_json", None, [text]).content == text
    out = answer("mistral", None, [OUTPUTS["mistral"][0]])
    assert out.content == "Sure." and json.loads(out.tool_calls[0].arguments) == {"a": 5, "b": 6}
    for text in OUTPUTS["mistral"][1:]:
        assert answer("mistral", None, [text]).content == text


def test_finish_reason_is_tool_calls_only_after_calls() -> None:
    tools = ChatTools((WEATHER,), ToolChoice("auto"))
    reader = ChatParsing("hermes").parser(tools)
    assert reader is not None
    _, finish = reader.step(
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', "stop"
    )
    assert finish == "tool_calls"
    reader = ChatParsing("hermes").parser(tools)
    assert reader is not None and reader.step("hello", "stop")[1] == "stop"
    reader = ChatParsing("hermes").parser(tools)
    assert reader is not None and reader.step("<tool_call>{", "length")[1] == "length"


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        (
            "qwen3",
            "<think>Paris is in France.</think>\n\nIt is sunny.",
            "Paris is in France.",
            "\n\nIt is sunny.",
        ),
        ("qwen3", "No thinking here.", "", "No thinking here."),
        ("qwen3", "<think>cut short by max_tokens", "cut short by max_tokens", ""),
        ("deepseek_r1", "reasoning first</think>answer", "reasoning first", "answer"),
        ("deepseek_r1", "<think>reasoning</think>answer", "reasoning", "answer"),
        ("deepseek_r1", "all reasoning, never closed", "all reasoning, never closed", ""),
    ],
)
def test_reasoning_split_for_any_cuts(name: str, text: str, reasoning: str, content: str) -> None:
    rng = random.Random(1)
    for chunks in [[text], list(text), *(cuts(text, rng) for _ in range(50))]:
        parser = ReasoningParser(name)
        got_reasoning = got_content = ""
        for chunk in chunks:
            split = parser.feed(chunk)
            got_reasoning += split.reasoning
            got_content += split.content
        split = parser.finish()
        assert (got_reasoning + split.reasoning, got_content + split.content) == (
            reasoning,
            content,
        )


def test_end_of_thinking_split_across_chunks_is_held_back() -> None:
    parser = ReasoningParser("qwen3")
    assert parser.feed("<think>abc</th").reasoning == "abc"  # "</th" may be the marker
    split = parser.feed("ink>answer")
    assert (split.reasoning, split.content) == ("", "answer")


def test_reasoning_then_tool_call() -> None:
    text = (
        "<think>need weather</think>\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    rng = random.Random(2)
    whole = without_ids(answer("hermes", "qwen3", [text]))
    assert whole == ("", "need weather", [(0, "get_weather", '{"city": "Rome"}')])
    for _ in range(50):
        assert without_ids(answer("hermes", "qwen3", cuts(text, rng))) == whole


def test_parser_detected_from_the_chat_template() -> None:
    assert detect_tool_parser("... <tool_call> ...") == "hermes"
    assert detect_tool_parser("[TOOL_CALLS] ...") == "mistral"
    assert detect_tool_parser("{{ messages }}") is None
    assert detect_tool_parser("<tool_call> [TOOL_CALLS]") is None  # ambiguous
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ChatParsing("nope")
    assert make_tool_parser("hermes", NAMES).feed("hi").content == "hi"


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize(
    "choice",
    [ToolChoice("required"), ToolChoice("function", "add"), ToolChoice("auto")],
)
@pytest.mark.parametrize("parallel", [True, False])
def test_tool_call_grammars_compile(parser: str, choice: ToolChoice, parallel: bool) -> None:
    grammar = tool_call_grammar(parser, ChatTools((WEATHER, ADD), choice, parallel))
    error = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar))
    assert error == "", f"{error}\n{grammar}"


@pytest.mark.parametrize("end_is_one_token", [False, True])
def test_reasoning_tokens_run_to_the_one_that_completes_the_think_block(
    end_is_one_token: bool,
) -> None:
    """Counted by the end marker's id where it is one (added) token, else by the shortest
    prefix whose text holds it: the same count either way, and whatever the chunks."""
    from kvserve.openai.reasoning import think_end_finder
    from kvserve.testing.tokenizers import build_byte_level_tokenizer

    tokenizer = build_byte_level_tokenizer()
    if end_is_one_token:
        tokenizer.add_tokens(["</think>"], special_tokens=True)
    think = tokenizer.encode("<think>the cache keeps", add_special_tokens=False)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    answer = tokenizer.encode(" keys and values", add_special_tokens=False)
    assert (len(end) == 1) == end_is_one_token
    ids = think + end + answer
    ends_at = think_end_finder(tokenizer)
    for name in ("qwen3", "deepseek_r1"):
        parser = ChatOutputParser(ReasoningParser(name), None, think_end=ends_at)
        for i, token in enumerate(ids):
            parser.step(tokenizer.decode([token]), "stop" if i == len(ids) - 1 else None, [token])
        assert parser.reasoning_tokens(ids) == len(think) + len(end)
    # No block: none; a block never closed (cut by max_tokens): all of them.
    plain = ChatOutputParser(ReasoningParser("qwen3"), None, think_end=ends_at)
    plain.step(tokenizer.decode(answer), "stop", answer)
    assert plain.reasoning_tokens(answer) == 0
    open_ = ChatOutputParser(ReasoningParser("qwen3"), None, think_end=ends_at)
    open_.step(tokenizer.decode(think), "length", think)
    assert open_.reasoning_tokens(think) == len(think)
