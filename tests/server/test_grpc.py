"""The engine's gRPC streaming API, end to end over a real channel.

Each test runs its own event loop (``asyncio.run``): a real ``LLMEngine`` (shared by the
module, tiny checkpoint on CPU) behind an ``AsyncEngine`` and a grpc.aio server on a free
loopback port, talked to through ``grpc.aio.insecure_channel``. Synchronisation is by
polling with deadlines, never by sleeping.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import MERGE_AFTER
from kvserve.engine.llm_engine import LLMEngine
from kvserve.llm import LLM
from kvserve.rpc import codec
from kvserve.rpc import engine_pb2 as pb
from kvserve.sampling_params import SamplingParams
from kvserve.server.grpc_service import EngineServicer, start_grpc_server
from kvserve.testing.checkpoints import build_random_checkpoint
from tests.support.grpc_engine import BLOCK_SIZE, LONG, PROMPT, Served, request, serve
from tests.support.waiting import eventually

MAX_NUM_SEQS = 2  # small, so a third concurrent request has to wait


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir: Callable[[str], Path]) -> Path:
    return checkpoint_dir("llama")


@pytest.fixture(scope="module")
def llm_engine(model_dir: Path) -> Iterator[LLMEngine]:
    cfg = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
    )
    yield LLMEngine(cfg)


async def expect_error(call: Any, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == code, info.value.details()
    return info.value


# ---- Generate ---------------------------------------------------------------------------
def test_stream_matches_offline_generate(llm_engine: LLMEngine, model_dir: Path) -> None:
    max_tokens = 12
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=BLOCK_SIZE)
    [expected] = llm.generate(
        PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    responses: list[pb.GenerateResponse] = []

    async def body(s: Served) -> None:
        async for resp in s.stub.Generate(request("stream-1", max_tokens)):
            responses.append(resp)

    serve(llm_engine, body)

    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds == ["delta"] * (len(responses) - 1) + ["final"]
    deltas = [r.delta for r in responses[:-1]]
    final = responses[-1].final
    token_ids = [t for delta in deltas for t in delta.token_ids]
    assert token_ids == expected.outputs[0].token_ids
    assert "".join(delta.text for delta in deltas) == expected.outputs[0].text
    assert all(not delta.logprobs for delta in deltas)

    assert final.finish_reason == "length"
    assert not final.HasField("stop_reason") and not final.HasField("stop_token_id")
    assert final.usage.completion_tokens == len(token_ids) == max_tokens
    assert final.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert 0 <= final.usage.cached_tokens < final.usage.prompt_tokens
    assert final.queue_time >= 0
    assert 0 < final.ttft <= final.e2e
    assert final.tpot > 0
    assert final.tpot == pytest.approx((final.e2e - final.ttft) / (max_tokens - 1))
    assert final.num_preemptions == 0


def test_stream_token_prompt_stop_token_and_logprobs(llm_engine: LLMEngine) -> None:
    prompt_ids = llm_engine.tokenizer.encode(PROMPT)
    greedy: list[int] = []

    async def body(s: Served) -> None:
        # Learn the greedy continuation, then stop on its first token not seen before.
        async for resp in s.stub.Generate(
            request("probe", 6, prompt_token_ids=pb.TokenIds(ids=prompt_ids))
        ):
            greedy.extend(resp.delta.token_ids)
        k = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
        responses = [
            resp
            async for resp in s.stub.Generate(
                request(
                    "stop-token",
                    8,
                    prompt_token_ids=pb.TokenIds(ids=prompt_ids),
                    stop_token_ids=[greedy[k]],
                    logprobs=2,
                )
            )
        ]
        final = responses[-1].final
        deltas = [r.delta for r in responses[:-1]]
        assert [t for d in deltas for t in d.token_ids] == greedy[: k + 1]
        assert final.finish_reason == "stop"
        assert final.HasField("stop_token_id") and final.stop_token_id == greedy[k]
        assert not final.HasField("stop_reason")
        assert final.usage.completion_tokens == k + 1
        for delta in deltas:
            assert [lp.token_id for lp in delta.logprobs] == list(delta.token_ids)
            assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in delta.logprobs)

    serve(llm_engine, body)


def test_chat_is_rendered_with_the_models_template(llm_engine: LLMEngine) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    expected = llm_engine.chat_prompt(messages)

    async def body(s: Served) -> None:
        chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages])
        req = pb.GenerateRequest(request_id="chat-1", chat=chat, temperature=0.0, logprobs=1)
        req.max_tokens = 5
        responses = [resp async for resp in s.stub.Generate(req)]
        final = responses[-1].final
        assert final.usage.prompt_tokens == len(expected)
        tok = llm_engine.tokenizer
        for delta in (r.delta for r in responses[:-1]):
            for lp in delta.logprobs:  # token texts travel with the ids (no client tokenizer)
                assert lp.token == tok.decode([lp.token_id])
                assert dict(lp.top_tokens) == {t: tok.decode([t]) for t in lp.top}
        empty = pb.GenerateRequest(request_id="chat-2", chat=pb.ChatMessages())
        error = await expect_error(s.stub.Generate(empty), grpc.StatusCode.INVALID_ARGUMENT)
        assert codec.error_fields(error.trailing_metadata())[0] == "chat"

    serve(llm_engine, body)


def _chat(role: str) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=role, content="hi")])


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt_token_ids": pb.TokenIds(ids=[5] * 1100)}, "prompt"),  # > max_model_len
        ({"max_tokens": 1020}, "max_tokens"),  # prompt + max_tokens > max_model_len
        ({"prompt_text": ""}, "prompt"),
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        # what HTTP refuses, a direct gRPC client may not send either
        ({"request_id": "a\nforged log line"}, "request_id"),
        ({"request_id": "x" * 129}, "request_id"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"max_tokens_cap": 0}, "max_tokens_cap"),
        ({"chat": _chat("bogus")}, "chat.messages[0].role"),
        ({"tools": [pb.Tool(name="f", parameters_json="{}")]}, "tools"),  # a text prompt
        ({"chat": _chat("user"), "echo": True}, "echo"),  # echo needs text or token ids
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"max_tokens": 0, "echo": True}, "max_tokens"),  # 0 only when scoring the prompt
        (
            {"chat": _chat("user"), "tools": [pb.Tool(name='a"b', parameters_json="{}")]},
            "tools[0].function.name",
        ),
        # nested past json's recursion limit: a RecursionError, not a ValueError
        ({"chat": _chat("user"), "chat_template_kwargs_json": "[" * 1500}, "chat_template_kwargs"),
        (
            {"chat": _chat("user"), "tools": [pb.Tool(name="f", parameters_json="[" * 1500)]},
            "tools[0].function.parameters",
        ),
    ],
)
def test_invalid_argument_names_the_param(
    llm_engine: LLMEngine, fields: dict[str, Any], param: str
) -> None:
    async def body(s: Served) -> None:
        req = request("bad", 8)
        for name, value in fields.items():
            if isinstance(value, pb.TokenIds | pb.ChatMessages):
                getattr(req, name).CopyFrom(value)
            elif isinstance(value, list):
                getattr(req, name).extend(value)
            else:
                setattr(req, name, value)
        error = await expect_error(s.stub.Generate(req), grpc.StatusCode.INVALID_ARGUMENT)
        # The parameter travels as a structured field, never inside the message.
        assert codec.error_fields(error.trailing_metadata())[0] == param

    serve(llm_engine, body)


def test_stop_strings_over_the_limits_are_refused(llm_engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        for stop in ([f"s{i}" for i in range(17)], ["x" * 257]):
            call = s.stub.Generate(request("many-stops", 4, stop=stop))
            error = await expect_error(call, grpc.StatusCode.INVALID_ARGUMENT)
            assert codec.error_fields(error.trailing_metadata())[0] == "stop"

    serve(llm_engine, body)


def test_missing_prompt(llm_engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        error = await expect_error(
            s.stub.Generate(pb.GenerateRequest(request_id="no-prompt", max_tokens=4)),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert codec.error_fields(error.trailing_metadata())[0] == "prompt"

    serve(llm_engine, body)


def test_requests_sharing_a_client_id_both_run(llm_engine: LLMEngine) -> None:
    """The client's id is not the engine's key: a second request with an id that is in
    use runs to the end, and so does the first; an empty id is allowed."""

    async def body(s: Served) -> None:
        running = s.stub.Generate(request("dup", LONG))
        assert (await running.read()).WhichOneof("kind") == "delta"
        second = [r async for r in s.stub.Generate(request("dup", 4))]
        assert second[-1].final.finish_reason == "length"
        assert second[-1].final.usage.completion_tokens == 4
        while (last := await running.read()).WhichOneof("kind") == "delta":
            pass
        assert last.final.usage.completion_tokens == LONG
        anonymous = [r async for r in s.stub.Generate(request("", 2))]
        assert anonymous[-1].final.usage.completion_tokens == 2

    serve(llm_engine, body)


def test_abort_rpc_aborts_every_request_with_that_client_id(llm_engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        calls = [s.stub.Generate(request("twin", LONG)) for _ in range(MAX_NUM_SEQS)]
        for call in calls:
            assert (await call.read()).WhichOneof("kind") == "delta"
        await s.stub.Abort(pb.AbortRequest(request_id="twin"))
        finals = []
        for call in calls:
            while (last := await call.read()).WhichOneof("kind") == "delta":
                pass
            finals.append(last.final)
        assert [f.finish_reason for f in finals] == ["abort"] * MAX_NUM_SEQS
        assert all(f.usage.completion_tokens < LONG for f in finals)

    serve(llm_engine, body)


# ---- cancellation -------------------------------------------------------------------------
def test_client_cancel_aborts_in_engine(llm_engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        call = s.stub.Generate(request("cancel-me", LONG))
        for _ in range(2):
            assert (await call.read()).WhichOneof("kind") == "delta"
        assert s.client_ids() == ["cancel-me"]
        assert call.cancel()
        await eventually(s.is_idle)
        assert s.engine.num_in_flight == 0
        assert await call.code() == grpc.StatusCode.CANCELLED

    serve(llm_engine, body)


def test_deadline_expiry_aborts_in_engine(llm_engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        call = s.stub.Generate(request("too-slow", LONG), timeout=0.5)
        seen = 0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for resp in call:
                assert resp.WhichOneof("kind") == "delta"  # never the Final
                seen += 1
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert seen > 0  # it was generating when the deadline hit
        await eventually(s.is_idle)
        assert s.engine.num_in_flight == 0

    serve(llm_engine, body)


def test_abort_rpc_ends_the_stream(llm_engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        call = s.stub.Generate(request("abort-me", LONG))
        assert (await call.read()).WhichOneof("kind") == "delta"
        await s.stub.Abort(pb.AbortRequest(request_id="abort-me"))
        rest: list[pb.GenerateResponse] = []
        while (resp := await call.read()) is not grpc.aio.EOF:
            rest.append(resp)
        final = rest[-1].final
        assert rest[-1].WhichOneof("kind") == "final"
        assert final.finish_reason == "abort"
        assert 0 < final.usage.completion_tokens < LONG
        assert await call.code() == grpc.StatusCode.OK
        await eventually(s.is_idle)
        # Unknown ids are ignored.
        await s.stub.Abort(pb.AbortRequest(request_id="no-such-request"))

    serve(llm_engine, body)


# ---- GenerateMany ---------------------------------------------------------------------------
def start(tag: int, req: pb.GenerateRequest, **metadata: str) -> pb.TaggedCommand:
    return pb.TaggedCommand(tag=tag, start=req, metadata=metadata)


def cancel(tag: int) -> pb.TaggedCommand:
    return pb.TaggedCommand(tag=tag, cancel=pb.Cancel())


async def read_until_ended(
    call: Any, tags: set[int]
) -> tuple[dict[int, list[pb.TaggedOutput]], list[pb.GenerateManyResponse]]:
    """Read a GenerateMany call until every tag in ``tags`` has its Final or Error
    (outputs of other tags are kept too)."""
    outputs: dict[int, list[pb.TaggedOutput]] = defaultdict(list)
    messages: list[pb.GenerateManyResponse] = []
    open_ = set(tags)
    while open_:
        message = await call.read()
        assert message is not grpc.aio.EOF, f"the call ended with {open_} still open"
        messages.append(message)
        for out in message.outputs:
            outputs[out.tag].append(out)
            if out.WhichOneof("kind") != "delta":
                open_.discard(out.tag)
    return outputs, messages


async def read_until_delta(
    call: Any, tag: int
) -> tuple[dict[int, list[pb.TaggedOutput]], list[pb.GenerateManyResponse]]:
    """Read a GenerateMany call until ``tag`` has sent a delta (it is running)."""
    outputs: dict[int, list[pb.TaggedOutput]] = defaultdict(list)
    messages: list[pb.GenerateManyResponse] = []
    while not outputs[tag]:
        message = await call.read()
        assert message is not grpc.aio.EOF, f"the call ended before tag {tag} ran"
        messages.append(message)
        for out in message.outputs:
            outputs[out.tag].append(out)
    return outputs, messages


def test_generate_many_streams_each_request_as_generate_does_in_shared_messages(
    llm_engine: LLMEngine,
) -> None:
    lengths = {1: 6, 2: 10}

    async def body(s: Served) -> None:
        expected = {
            tag: [resp async for resp in s.stub.Generate(request(f"alone-{tag}", n))]
            for tag, n in lengths.items()
        }
        call = s.stub.GenerateMany()
        await call.write(
            pb.GenerateManyRequest(
                commands=[start(tag, request(f"many-{tag}", n)) for tag, n in lengths.items()]
            )
        )
        outputs, messages = await read_until_ended(call, set(lengths))
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK

        for tag, n in lengths.items():
            got = outputs[tag]
            assert [o.WhichOneof("kind") for o in got] == ["delta"] * (len(got) - 1) + ["final"]
            alone = expected[tag]
            tokens = [t for o in got[:-1] for t in o.delta.token_ids]
            assert tokens == [t for r in alone[:-1] for t in r.delta.token_ids]
            assert "".join(o.delta.text for o in got[:-1]) == "".join(
                r.delta.text for r in alone[:-1]
            )
            final = got[-1].final
            assert final.finish_reason == "length" and final.usage.completion_tokens == n
            assert final.usage.prompt_tokens == alone[-1].final.usage.prompt_tokens
        # Both requests ran in the same steps: their deltas shared messages.
        assert any(len({o.tag for o in m.outputs}) == 2 for m in messages)
        assert len(messages) < sum(len(o) for o in outputs.values())

    serve(llm_engine, body)


class StalledReader:
    """The servicer's side of a GenerateMany call whose client has stopped reading: each
    write waits until ``reading`` is set, as one does once the client's flow-control
    window is full (gRPC itself buffers megabytes first, which a test would have to fill)."""

    def __init__(self) -> None:
        self.reading = asyncio.Event()
        self.messages: list[pb.GenerateManyResponse] = []

    async def write(self, message: pb.GenerateManyResponse) -> None:
        await self.reading.wait()
        self.messages.append(message)


def test_a_generate_many_client_that_stops_reading_gets_its_steps_merged(
    llm_engine: LLMEngine,
) -> None:
    """While a client reads nothing, its requests run to their end and the server holds
    at most MERGE_AFTER outputs per request, the later steps merged into the last, not a
    message per request and step (a client that never reads again would otherwise grow
    the server without bound). Read afterwards: the tokens, text and logprobs of a
    reading client, in fewer deltas than steps."""
    n, tags = 200, (1, 2)

    async def body(s: Served) -> None:
        alone = [r async for r in s.stub.Generate(request("alone", n, logprobs=5))]
        client, ended = StalledReader(), asyncio.Event()

        async def commands() -> AsyncIterator[pb.GenerateManyRequest]:
            starts = [start(t, request(f"stalled-{t}", n, logprobs=5)) for t in tags]
            yield pb.GenerateManyRequest(commands=starts)
            await ended.wait()  # the client half-closes once it has read everything

        call = asyncio.create_task(EngineServicer(s.engine).GenerateMany(commands(), client))
        # Both in the engine (a step takes milliseconds, the two ~n steps), then both
        # ran to their end.
        await eventually(lambda: s.client_ids() == [f"stalled-{t}" for t in tags])
        await eventually(lambda: not s.engine.engine.requests)
        client.reading.set()
        await eventually(
            lambda: (
                {o.tag for m in client.messages for o in m.outputs if o.HasField("final")}
                == set(tags)
            )
        )
        ended.set()
        await call
        outputs = defaultdict(list)
        for message in client.messages:
            for out in message.outputs:
                outputs[out.tag].append(out)
        for tag in tags:
            deltas = [o.delta for o in outputs[tag][:-1]]
            assert outputs[tag][-1].final.usage.completion_tokens == n
            # The step written before the stall, MERGE_AFTER waiting, the last of them
            # holding the rest.
            assert len(deltas) <= 1 + MERGE_AFTER < n
            assert [t for d in deltas for t in d.token_ids] == [
                t for r in alone[:-1] for t in r.delta.token_ids
            ]
            assert "".join(d.text for d in deltas) == "".join(r.delta.text for r in alone[:-1])
            got = [e for d in deltas for e in d.logprobs]
            want = [e for r in alone[:-1] for e in r.delta.logprobs]
            assert [(e.token_id, sorted(e.top)) for e in got] == [
                (e.token_id, sorted(e.top)) for e in want
            ]

    serve(llm_engine, body)


def test_generate_many_refuses_bad_commands_one_by_one(llm_engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        call = s.stub.GenerateMany()
        commands = [
            start(1, request("many-bad", 0)),  # max_tokens 0
            start(2, request("many-long", LONG)),
            start(3, request("many-long", 4)),  # the client id is in use: allowed
            start(4, pb.GenerateRequest(request_id="many-no-prompt")),
        ]
        await call.write(pb.GenerateManyRequest(commands=commands))
        outputs, _ = await read_until_ended(call, {1, 3, 4})
        errors = {tag: outputs[tag][-1].error for tag in (1, 4)}
        assert all(e.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for e in errors.values())
        assert (errors[1].param, errors[4].param) == ("max_tokens", "prompt")
        assert outputs[3][-1].final.usage.completion_tokens == 4

        # The long request carries on; a cancel ends it, and one of an unknown tag is ignored.
        await eventually(lambda: s.client_ids() == ["many-long"])
        await call.write(pb.GenerateManyRequest(commands=[cancel(2), cancel(99)]))
        _, messages = await read_until_ended(call, {2})
        ends = [o for m in messages for o in m.outputs if o.WhichOneof("kind") != "delta"]
        assert [(o.tag, o.WhichOneof("kind")) for o in ends] == [(2, "final")]
        assert ends[0].final.finish_reason == "abort"
        assert 0 < ends[0].final.usage.completion_tokens < LONG
        call.cancel()

    serve(llm_engine, body)


def test_a_start_with_the_tag_of_an_open_request_ends_both_with_one_error(
    llm_engine: LLMEngine,
) -> None:
    """The client could not tell the two requests' outputs apart: the open one is aborted
    and its tag ends with the Error alone, nothing after it."""

    async def body(s: Served) -> None:
        call = s.stub.GenerateMany()
        await call.write(pb.GenerateManyRequest(commands=[start(1, request("first", LONG))]))
        await read_until_delta(call, 1)
        await call.write(pb.GenerateManyRequest(commands=[start(1, request("again", 4))]))
        ended, _ = await read_until_ended(call, {1})
        error = ended[1][-1].error
        assert ended[1][-1].WhichOneof("kind") == "error", ended[1][-1]
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "tag 1" in error.message
        await eventually(s.is_idle)  # the first request was aborted, the second never ran

        # A request that runs after the Error sees no more of tag 1 on the call.
        await call.write(pb.GenerateManyRequest(commands=[start(2, request("after", 6))]))
        later, _ = await read_until_ended(call, {2})
        assert set(later) == {2}, later.keys()
        assert later[2][-1].final.usage.completion_tokens == 6
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK

    serve(llm_engine, body)


def test_a_request_slow_to_start_holds_up_no_other_request_on_the_call(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Through the gateway one GenerateMany call carries every tenant's requests to a
    replica, so a start that takes long to build (here the longest prompt a 64k context
    takes, about a second to tokenize) must not hold up the starts and cancels behind it;
    a cancel ends it before it reaches the engine."""
    model = build_random_checkpoint(
        tmp_path_factory.mktemp("long-context"), "llama", max_position_embeddings=65536
    )
    cfg = EngineConfig(
        model=str(model), dtype="float32", device="cpu", max_model_len=65536, num_kv_blocks=64
    )
    engine = LLMEngine(cfg)
    assert engine.max_prompt_chars is not None
    long = (PROMPT + " ") * (engine.max_prompt_chars // (len(PROMPT) + 1))
    # transformers warns once per tokenizer of a text over its model_max_length: now,
    # while pytest captures the log, not from the cancelled tokenization after the test.
    engine.tokenize(long[: len(long) // 100])

    async def body(s: Served) -> None:
        call = s.stub.GenerateMany()
        slow, quick = request("slow", 2, prompt_text=long), request("quick", 2)
        await call.write(pb.GenerateManyRequest(commands=[start(1, slow), start(2, quick)]))
        ends: list[tuple[int, str]] = []
        while (2, "final") not in ends:
            message = await call.read()
            ends += [(o.tag, str(o.WhichOneof("kind"))) for o in message.outputs]
        # The quick one ran to its end while the slow one was still being tokenized.
        assert [end for end in ends if end[1] != "delta"] == [(2, "final")]
        await call.write(pb.GenerateManyRequest(commands=[cancel(1)]))
        outputs, _ = await read_until_ended(call, {1})
        assert [o.final.finish_reason for o in outputs[1]] == ["abort"]
        call.cancel()

    serve(engine, body)


def test_ending_a_generate_many_call_aborts_its_requests(llm_engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        call = s.stub.GenerateMany()
        commands = [start(tag, request(f"orphan-{tag}", LONG)) for tag in (1, 2)]
        await call.write(pb.GenerateManyRequest(commands=commands))
        seen: set[int] = set()
        while seen != {1, 2}:
            seen |= {o.tag for o in (await call.read()).outputs}
        assert s.client_ids() == ["orphan-1", "orphan-2"]
        assert call.cancel()
        await eventually(s.is_idle)
        assert s.engine.num_in_flight == 0

    serve(llm_engine, body)


def test_a_consumer_that_fails_on_its_output_loses_only_its_own_request(
    llm_engine: LLMEngine,
) -> None:
    async def body(s: Served) -> None:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        outputs: list[Any] = []
        finished = asyncio.Event()

        def failing(out: Any) -> None:
            raise RuntimeError("a consumer bug")

        def healthy(out: Any) -> None:
            outputs.append(out)
            if not isinstance(out, BaseException) and out.finished:
                finished.set()

        # Started together, so their outputs come in the same steps (one dispatch each).
        s.engine.add_request(s.engine.make_request(PROMPT, params, "broken"), failing)
        fine = s.engine.make_request(PROMPT, params, "fine")
        s.engine.add_request(fine, healthy)
        await asyncio.wait_for(finished.wait(), timeout=30)
        s.engine.release(fine.request_id, abort=False)
        assert not any(isinstance(o, BaseException) for o in outputs)
        assert len(outputs[-1].outputs[0].token_ids) == 6
        await eventually(s.is_idle)  # the failing consumer's request was aborted
        assert s.engine.num_in_flight == 0

    serve(llm_engine, body)


# ---- Health and GetLoad -------------------------------------------------------------------
def test_health_serving(llm_engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        resp = await s.stub.Health(pb.HealthRequest())
        assert resp.serving
        assert resp.message == "ok"

    serve(llm_engine, body)


def test_a_draining_server_refuses_new_requests_unavailable(llm_engine: LLMEngine) -> None:
    """While the server drains (``admitting`` false) new gRPC requests are refused
    UNAVAILABLE, which the gateway retries elsewhere, on both calls, and Health says so;
    a request admitted before the drain runs to its end."""
    admitting = [True]

    async def body(s: Served) -> None:
        running = s.stub.Generate(request("before", 6))
        first = await running.read()
        assert first.HasField("delta")
        admitting[0] = False
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await s.stub.Generate(request("after", 4)).read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in (refused.value.details() or "")
        many = s.stub.GenerateMany()
        await many.write(pb.GenerateManyRequest(commands=[start(1, request("m", 4))]))
        outputs, _ = await read_until_ended(many, {1})
        (answer,) = outputs[1]
        assert answer.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        await many.done_writing()
        health = await s.stub.Health(pb.HealthRequest())
        assert not health.serving and "draining" in health.message
        last = first
        while (message := await running.read()) is not grpc.aio.EOF:
            last = message
        assert last.final.finish_reason == "length"

    serve(llm_engine, body, admitting=lambda: admitting[0])


def test_a_taken_port_is_an_error_not_a_shared_port(llm_engine: LLMEngine) -> None:
    # Without so_reuseport=0, gRPC binds a port another server holds and the two share
    # its connections: a replica started twice on one port must fail instead.
    async def body(s: Served) -> None:
        with pytest.raises(OSError, match=f"127.0.0.1:{s.port} .*in use"):
            await start_grpc_server(s.engine, "127.0.0.1", s.port)
        assert (await s.stub.Health(pb.HealthRequest())).serving

    serve(llm_engine, body)


def test_get_load_while_running_and_after(llm_engine: LLMEngine) -> None:
    async def body(s: Served) -> None:
        idle = await s.stub.GetLoad(pb.GetLoadRequest())
        assert (idle.num_running, idle.num_waiting, idle.kv_cache_usage) == (0, 0, 0.0)
        assert idle.block_size == BLOCK_SIZE
        assert idle.num_blocks == idle.num_free_blocks == llm_engine.num_kv_blocks

        ids = [f"load-{i}" for i in range(MAX_NUM_SEQS + 1)]
        calls = [s.stub.Generate(request(rid, LONG)) for rid in ids]
        loads: list[pb.GetLoadResponse] = []

        async def busy() -> bool:
            load = await s.stub.GetLoad(pb.GetLoadRequest())
            loads.append(load)
            return bool(load.num_running == MAX_NUM_SEQS and load.num_waiting == 1)

        deadline = time.monotonic() + 10
        while not await busy():
            assert time.monotonic() < deadline, f"never saw a full batch: {loads[-1]}"
        load = loads[-1]
        assert 0 < load.kv_cache_usage < 1
        assert load.num_free_blocks < load.num_blocks

        for rid in ids:
            await s.stub.Abort(pb.AbortRequest(request_id=rid))
        for call in calls:
            finals = [r.final for r in [resp async for resp in call] if r.HasField("final")]
            assert [f.finish_reason for f in finals] == ["abort"]

        await eventually(s.is_idle)
        after = await s.stub.GetLoad(pb.GetLoadRequest())
        assert (after.num_running, after.num_waiting, after.kv_cache_usage) == (0, 0, 0.0)
        assert after.num_free_blocks == after.num_blocks

    serve(llm_engine, body)
