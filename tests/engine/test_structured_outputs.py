"""Structured outputs in the engine: grammar-constrained sampling with llguidance.

A random-weight model follows the grammar only because the sampler masks its logits, so
every output that validates here was forced by the grammar (docs/engine.md, "Structured
outputs").
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import re
import threading
from typing import Any

import jsonschema
import llguidance
import llguidance.torch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.engine.async_engine import AsyncEngine, RequestFailedError
from kvserve.errors import InvalidRequestError
from kvserve.structured import MAX_GRAMMAR_CHARS, grammar_of, validate
from kvserve.structured.tokenizer import ll_tokenizer
from tests.support.device import TEST_DEVICE

Schema = dict[str, Any]
WAIT = 60  # seconds: a bound for waits that an event ends, never a synchronisation


def constrained(max_tokens: int = 64, seed: int = 0, **kind: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def make_llm(checkpoint_dir: Any, **options: Any) -> LLM:
    return LLM(
        str(checkpoint_dir("llama")),
        dtype="float32",
        device=TEST_DEVICE,
        max_model_len=512,
        **options,
    )


@pytest.fixture(scope="module")
def llm(checkpoint_dir) -> LLM:  # type: ignore[no-untyped-def]
    return make_llm(checkpoint_dir, max_num_seqs=128)


# ---- random schemas ----------------------------------------------------------------------
# Every instance is short: a random-weight model stops only where the grammar makes it,
# so strings have a maxLength, arrays a maxItems, numbers bounds, and objects take no
# other properties. Within that: every type, enum/const, anyOf, $ref, formats, patterns,
# nesting.
WORDS = ["id", "name", "kind", "price", "tags", "ok", "city", "n", "meta", "when"]


def random_schemas(count: int, seed: int) -> list[Schema]:
    """``count`` different schemas, the same ones for the same seed."""
    rng = random.Random(seed)
    schemas: dict[str, Schema] = {}
    while len(schemas) < count:
        schema = _any(rng, depth=0)
        if rng.random() < 0.1:  # a definition used by reference
            schema = {
                "$defs": {"item": _leaf(rng)},
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/item"}, "b": {"$ref": "#/$defs/item"}},
                "required": ["a"],
                "additionalProperties": False,
            }
        schemas.setdefault(json.dumps(schema), schema)
    return list(schemas.values())


def _any(rng: random.Random, depth: int) -> Schema:
    if depth >= 2 or rng.random() < 0.35:
        return _leaf(rng)
    pick = rng.random()
    if pick < 0.55:
        names = rng.sample(WORDS, rng.randint(1, 4))
        return {
            "type": "object",
            "properties": {n: _any(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.7],
            "additionalProperties": False,
        }
    if pick < 0.85:
        items = _any(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": rng.randint(0, 1), "maxItems": 2}
    return {"anyOf": [_leaf(rng), _any(rng, depth + 1)]}


def _leaf(rng: random.Random) -> Schema:
    kind = rng.choice(["string", "string", "integer", "boolean", "null", "enum", "const", "more"])
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 6)}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", 3, None, True, "blue sky", 2.5], 3)}
    if kind == "const":
        return {"const": rng.choice(["fixed", 7, False])}
    if kind == "more":
        return rng.choice(
            [
                {"type": "string", "pattern": "^[a-z]{2,5}$"},
                {"type": "string", "pattern": "^[A-Z][0-9]{3}$"},
                {"type": "string", "format": "date"},
                {"type": "string", "format": "uuid"},
                {"type": "number", "minimum": -100, "maximum": 100},
            ]
        )
    return {"type": kind}


def test_outputs_validate_against_120_random_schemas(llm: LLM) -> None:
    schemas = random_schemas(120, seed=19)
    params = [constrained(256, seed=i, json=s) for i, s in enumerate(schemas)]
    outputs = llm.generate(["Reply in JSON:"] * len(schemas), params, use_tqdm=False)
    check = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for schema, out in zip(schemas, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema, format_checker=check)
    # Sampled at temperature 1: the outputs vary (not one forced path per schema).
    assert len({o.outputs[0].text for o in outputs}) > 100


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_grammar_accepts_every_instance_of_its_schema(llm: LLM, data: st.DataObject) -> None:
    """The other direction, without the model: valid JSON (as json.dumps writes it, with
    properties in the schema's order) is never refused by the grammar, so the constraint
    does not narrow the schema."""
    schema = data.draw(st.sampled_from(random_schemas(40, seed=7)))
    instance = data.draw(instances(schema, schema))
    text = json.dumps(instance, ensure_ascii=False)
    tokenizer = llm.get_tokenizer()
    lltok = ll_tokenizer(tokenizer)
    grammar = grammar_of(StructuredOutputsParams(json=schema))
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert matcher.consume_tokens(tokens), (text, matcher.get_error())
    assert matcher.is_accepting()


def instances(schema: Schema, root: Schema) -> st.SearchStrategy[Any]:
    """Any instance of a schema from ``random_schemas`` (hypothesis-jsonschema would do
    this, but its object strategy fails with this hypothesis version)."""
    if "$ref" in schema:
        return instances(root["$defs"][schema["$ref"].split("/")[-1]], root)
    if "anyOf" in schema:
        return st.one_of([instances(s, root) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema["type"]
    if kind == "object":
        # Properties in the schema's order: the order the grammar writes them in.
        fields = [
            st.tuples(st.just(k), instances(v, root)) for k, v in schema["properties"].items()
        ]
        fields = [
            f if k in schema["required"] else st.one_of(st.none(), f)
            for k, f in zip(schema["properties"], fields, strict=True)
        ]
        return st.tuples(*fields).map(lambda kvs: dict(kv for kv in kvs if kv is not None))
    if kind == "array":
        items = instances(schema["items"], root)
        return st.lists(items, min_size=schema["minItems"], max_size=schema["maxItems"])
    if kind == "string" and "pattern" in schema:
        return st.from_regex(schema["pattern"].strip("^$"), fullmatch=True)
    if kind == "string" and "format" in schema:
        if schema["format"] == "date":
            return st.dates().map(lambda d: d.isoformat())
        return st.uuids().map(str)
    if kind == "string":
        # Any text but control characters, which llguidance never writes raw (nor should
        # a model).
        chars = st.characters(exclude_categories=["Cs", "Cc"])
        return st.text(chars, min_size=schema["minLength"], max_size=schema["maxLength"])
    if kind == "integer":
        return st.integers(schema["minimum"], schema["maximum"])
    if kind == "number":
        # Rounded, and 0 for -0: the grammar of a bounded number has no exponent (1e-05)
        # nor a negative zero.
        return st.floats(schema["minimum"], schema["maximum"]).map(lambda x: round(x, 4) + 0.0)
    return st.just({"boolean": True, "null": None}[kind])


# ---- each kind -------------------------------------------------------------------------
def test_each_kind_of_constraint(llm: LLM) -> None:
    choices = ["yes", "no", 'say "maybe"']
    kinds: list[dict[str, Any]] = [
        {"json": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}},
        {"json": '{"type": "array", "items": {"type": "boolean"}, "maxItems": 3}'},
        {"json_object": True},
        {"regex": r"[0-9]{3}-[a-z]{2,4}"},
        {"choice": choices},
        {"grammar": 'start: "<call>" %json {"type": "integer", "minimum": 0} "</call>"'},
        {"grammar": 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[A-Z][a-z]{1,5}/'},
    ]
    params = [constrained(128, seed=seed, **kind) for seed in range(3) for kind in kinds]
    outputs = [o.outputs[0] for o in llm.generate(["x"] * len(params), params)]
    assert all(o.finish_reason == "stop" for o in outputs), [o.text for o in outputs]
    for i in range(0, len(outputs), len(kinds)):
        obj, array, any_object, regex, choice, call, lark = (
            o.text for o in outputs[i : i + len(kinds)]
        )
        jsonschema.validate(json.loads(obj), kinds[0]["json"])
        assert isinstance(json.loads(array), list) and len(json.loads(array)) <= 3
        assert isinstance(json.loads(any_object), dict)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", regex)
        assert choice in choices
        assert re.fullmatch(r"<call>(0|[1-9][0-9]*)</call>", call)
        assert re.fullmatch(r"(hi|hello) [A-Z][a-z]{1,5}", lark)


def test_greedy_unconstrained_outputs_do_not_change(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["the cache keeps keys", "hello world"]
    alone = llm.generate(prompts, plain)
    mixed = llm.generate(
        [*prompts, "x", "y"],
        [plain, plain, constrained(12, json_object=True), constrained(12, regex="a+")],
    )
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in mixed[:2]]


def test_greedy_constrained_takes_the_best_allowed_token(llm: LLM) -> None:
    """Greedy under a mask is the argmax over the allowed tokens: the model's first choice
    among the grammar's; twice the same."""
    params = SamplingParams(
        max_tokens=32,
        temperature=0,
        structured_outputs=StructuredOutputsParams(regex="[a-z]{5}"),
    )
    first, again = llm.generate(["one", "one"], params)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    assert re.fullmatch("[a-z]{5}", first.outputs[0].text)


# ---- how a request ends ----------------------------------------------------------------
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_grammar_that_allows_only_eos_ends_with_stop(llm: LLM, ignore_eos: bool) -> None:
    params = SamplingParams(
        max_tokens=10,
        ignore_eos=ignore_eos,
        structured_outputs=StructuredOutputsParams(regex=""),
    )
    out = llm.generate(["anything"], params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == ""
    assert out.token_ids == [llm.get_tokenizer().eos_token_id]


def test_complete_output_ends_with_stop_without_eos(llm: LLM) -> None:
    out = llm.generate(["pick"], constrained(choice=["alpha", "beta"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("alpha", "beta")
    assert llm.get_tokenizer().eos_token_id not in out.token_ids


def test_max_tokens_still_ends_a_constrained_request(llm: LLM) -> None:
    out = llm.generate(["long"], constrained(3, regex="[a-z]{20}"))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


# ---- bad input -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
        ({"json": "[" * 5000}, "structured_outputs.json: JSON nested too deeply to read"),
        ({"json": "[1, 2]"}, "must be a JSON object"),
        ({"json": {"type": "strnig"}}, "Invalid type: strnig"),
        ({"json": {"type": "string", "format": "zipcode"}}, "Unknown format: zipcode"),
        ({"json": {"not": {"type": "string"}}}, "keywords that structured outputs do not support"),
        ({"json": {"type": "array", "uniqueItems": True}}, "not support: .*uniqueItems"),
        ({"regex": "(abc"}, "(?s)invalid structured_outputs regex: .*unclosed group"),
        ({"choice": ["a", 3]}, "non-empty list of strings"),
        (
            {"grammar": "start: undefined_rule"},
            'invalid structured_outputs grammar: .*"undefined_rule"',
        ),
        ({"grammar": 'start: "x" <|no_such_token|>'}, "unknown special token"),
        ({"grammar": "start: " + '"a" ' * MAX_GRAMMAR_CHARS}, "at most 131072 are allowed"),
        ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ],
)
def test_bad_constraints_are_refused_with_why(llm: LLM, kind: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as caught:
        validate(StructuredOutputsParams(**kind), llm.get_tokenizer())
    assert caught.value.param == "structured_outputs"
    # The engine refuses it the same way, and the other requests run on.
    engine = llm.engine
    engine.add_request("fine", "x", SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(
            "bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(**kind))
        )
    outs: list[Any] = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["fine"]
    assert outs[-1].outputs[0].finish_reason == "length"


def test_a_grammar_that_fails_in_the_engine_fails_only_its_request(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """Validated grammars compile, so a failure inside the engine is a bug; make one (the
    compile raises) and check that it ends its own request only."""
    engine = make_llm(checkpoint_dir).engine

    def fail(grammar: str) -> None:
        if "zzz" in grammar:
            raise RuntimeError("simulated compiler failure")

    engine.structured.compiler.before_compile = fail
    engine.add_request("bad", "x", constrained(regex="zzz+"))
    engine.add_request("good", "x", constrained(regex="[a-c]{4}"))
    engine.add_request("plain", "x", SamplingParams(max_tokens=5, ignore_eos=True))
    outs = run_to_end(engine)
    assert outs["bad"].outputs[0].finish_reason == "abort"
    assert re.fullmatch("[a-c]{4}", outs["good"].outputs[0].text)
    assert outs["plain"].outputs[0].finish_reason == "length"
    [(failed, why)] = engine.take_failures()
    assert failed.request_id == "bad" and "simulated compiler failure" in why


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        # Validate and compile, but match no text: their first mask fails (which then
        # allowed only EOS: an accepted EOS ended the request "stop" with an empty
        # answer). Found when compiled, before the request runs.
        ({"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}, "NoExtension"),
        ({"regex": "[^\\x00-\\U0010FFFF]"}, "the structured_outputs constraint matches no text"),
        # Validates and compiles, then grows past llguidance's limits on the first "a".
        ({"regex": "a{1000000}"}, "too many expressions"),
    ],
)
def test_a_grammar_that_cannot_go_on_fails_its_request_instead_of_ending_it(
    checkpoint_dir: Any, kind: dict[str, Any], why: str
) -> None:
    engine = make_llm(checkpoint_dir).engine
    engine.add_request("bad", "x", constrained(**kind))
    engine.add_request("plain", "x", SamplingParams(max_tokens=5, ignore_eos=True))
    outs = run_to_end(engine)
    assert outs["bad"].outputs[0].finish_reason == "abort"
    assert outs["plain"].outputs[0].finish_reason == "length"
    [(failed, message)] = engine.take_failures()
    assert failed.request_id == "bad" and why in message
    assert "<non-verbose/>" not in message  # llguidance's marker is not for clients


def run_to_end(engine: Any) -> dict[str, Any]:
    finished = {}
    while engine.has_unfinished_requests():
        if not engine.has_work():
            engine.wait_for_grammar(WAIT)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


# ---- compiling off the engine thread, and the cache --------------------------------------
class HeldCompiles:
    """A compiler hook that holds every compile until released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, grammar: str) -> None:
        self.threads.append(threading.current_thread())
        self.started.set()
        assert self.release.wait(WAIT)


def test_requests_keep_stepping_while_a_grammar_compiles(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    engine = make_llm(checkpoint_dir).engine
    held = HeldCompiles()
    engine.structured.compiler.before_compile = held
    engine.add_request("constrained", "x", constrained(regex="[0-9]{6}"))
    engine.add_request("plain", "x", SamplingParams(max_tokens=6, ignore_eos=True))
    assert held.started.wait(WAIT)
    outs = []
    while "plain" in engine.requests:
        outs += engine.step()
    # Six steps went by; the constrained request waited outside the batch, produced
    # nothing, and there is no work until its compile ends.
    assert {o.request_id for o in outs} == {"plain"} and len(outs) == 6
    assert list(engine.awaiting_grammar) == ["constrained"]
    assert not engine.has_work() and engine.has_unfinished_requests()
    assert engine.stats().num_waiting == 1
    held.release.set()
    done = run_to_end(engine)
    assert re.fullmatch("[0-9]{6}", done["constrained"].outputs[0].text)
    assert held.threads and threading.current_thread() not in held.threads


def test_compiled_grammars_are_cached_by_content(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(checkpoint_dir)
    compiler = llm.engine.structured.compiler
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    llm.generate(["x"], constrained(2, json=schema))
    assert (compiler.num_compiles, compiler.num_cache_hits) == (1, 0)
    # The same schema (as a dict again, or as its JSON text): no second compile.
    llm.generate(
        ["x", "y"], [constrained(2, json=dict(schema)), constrained(2, json=json.dumps(schema))]
    )
    assert (compiler.num_compiles, compiler.num_cache_hits) == (1, 2)
    llm.generate(["x"], constrained(2, json={**schema, "required": []}))
    assert compiler.num_compiles == 2


def test_async_engine_steps_others_while_a_grammar_compiles(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """Through the server's engine thread: a held compile does not hold the others; its
    completion wakes the thread; a grammar that fails in the engine fails its own stream
    with RequestFailedError and nothing else."""
    engine = make_llm(checkpoint_dir).engine
    held = HeldCompiles()

    def hook(grammar: str) -> None:
        if "zzz" in grammar:
            raise RuntimeError("simulated compiler failure")
        held(grammar)

    engine.structured.compiler.before_compile = hook

    async def collect(stream: Any) -> Any:
        last = None
        async for out in stream:
            last = out
        return last

    async def main() -> None:
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            waiting = asyncio.ensure_future(
                collect(aengine.generate("x", constrained(regex="[a-z]{3}")))
            )
            await asyncio.to_thread(held.started.wait, WAIT)
            plain = await collect(
                aengine.generate("x", SamplingParams(max_tokens=5, ignore_eos=True))
            )
            assert plain.outputs[0].finish_reason == "length" and not waiting.done()
            with pytest.raises(RequestFailedError, match="simulated compiler failure"):
                await collect(aengine.generate("x", constrained(regex="zzz")))
            held.release.set()
            out = await asyncio.wait_for(waiting, WAIT)
            assert re.fullmatch("[a-z]{3}", out.outputs[0].text)
            assert out.outputs[0].finish_reason == "stop"
        finally:
            held.release.set()
            await aengine.stop()

    asyncio.run(main())


def _accepts(llm: LLM, params: StructuredOutputsParams, text: str) -> bool:
    tokenizer = llm.get_tokenizer()
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar_of(params), log_level=0)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(tokens)) and matcher.is_accepting()


THINK_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("kind", [{"json": THINK_SCHEMA}, {"regex": "(yes|no) [0-9]+"}])
def test_a_think_block_comes_before_the_constraint(llm: LLM, kind: dict[str, Any]) -> None:
    """With a reasoning model the constraint applies after its <think>...</think> block:
    optional (Qwen3) or already open in the prompt (DeepSeek-R1)."""
    answer = '{"a": 1}' if "json" in kind else "yes 12"
    optional = StructuredOutputsParams(**kind, think_block="optional")
    assert _accepts(llm, optional, f"<think>any {{text}} </thin> here</think>{answer}")
    assert _accepts(llm, optional, answer)  # no reasoning at all
    assert not _accepts(llm, optional, "<think>x</think>not the answer")
    assert not _accepts(llm, optional, f"<think>x</think></think>{answer}")
    opened = StructuredOutputsParams(**kind, think_block="open")
    assert _accepts(llm, opened, f"first, the budget</think>{answer}")
    assert not _accepts(llm, opened, answer)  # the open block must close first


def test_added_tokens_that_are_not_special_are_text_to_the_grammar(llm: LLM) -> None:
    """Qwen's <think>, </think> and <tool_call> are added tokens that are not special: the
    tokenizer makes each one token from its text, and decoding keeps it. A grammar's
    literal for that text matches the token: inside a think block, where the mask must
    offer it, and where the literal is forced, where the matcher must take the token the
    mask offered (it refused it, failing the request)."""
    tokenizer = copy.deepcopy(llm.get_tokenizer())
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>"], special_tokens=False)
    think, end_think, call = tokenizer.convert_tokens_to_ids(["<think>", "</think>", "<tool_call>"])
    vocab = ll_tokenizer(tokenizer)

    def matcher(params: StructuredOutputsParams) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(vocab, grammar_of(params), log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def allowed(m: llguidance.LLMatcher) -> set[int]:
        mask = llguidance.torch.allocate_token_bitmask(1, vocab.vocab_size)
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        words = mask[0].tolist()
        return {i for i in range(vocab.vocab_size) if (words[i // 32] >> (i % 32)) & 1}

    thinking = matcher(StructuredOutputsParams(json=THINK_SCHEMA, think_block="optional"))
    assert think in allowed(thinking)
    assert thinking.consume_tokens([think, *tokenizer.encode("x", add_special_tokens=False)])
    assert end_think in allowed(thinking)
    assert thinking.consume_tokens(
        [end_think, *tokenizer.encode('{"a": 1}', add_special_tokens=False)]
    )
    assert thinking.is_accepting()

    forced = matcher(StructuredOutputsParams(grammar='start: "<tool_call>" "\\n" /[a-z]+/'))
    assert allowed(forced) == {call}
    assert forced.consume_tokens(tokenizer.encode("<tool_call>\nabc", add_special_tokens=False))
    assert forced.is_accepting(), forced.get_error()


def test_forced_text_that_spells_a_special_token_is_written_as_text(llm: LLM) -> None:
    """A literal that spells a special token ("</s>") is text: the mask offers its plain
    spelling, never the special token (the matcher refused the token it had offered,
    failing the request)."""
    tokenizer = llm.get_tokenizer()
    special = tokenizer.eos_token
    (out,) = llm.generate(["hello"], constrained(grammar=f'start: {json.dumps(special)} "ab"'))
    assert out.outputs[0].text == special + "ab"
    assert out.outputs[0].finish_reason == "stop"
    assert tokenizer.eos_token_id not in out.outputs[0].token_ids
