"""Seeded workloads: reproducible, sized to the context, each with its own character."""

from __future__ import annotations

import pytest

from kvserve.loadtest.workloads import (
    TOKENS_PER_WORD,
    WORKLOADS,
    RequestSpec,
    calibration_text,
    make_workload,
    system_prompt,
)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_requests(name: str) -> None:
    a, b, c = (make_workload(name, seed=s) for s in (7, 7, 8))
    first = [a.next() for _ in range(30)]
    assert first == [b.next() for _ in range(30)]
    assert first != [c.next() for _ in range(30)]


@pytest.mark.parametrize("tpw", [1.2, TOKENS_PER_WORD, 3.3])
@pytest.mark.parametrize("context", [256, 512, 4096])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_requests_fit_the_context(name: str, context: int, tpw: float) -> None:
    w = make_workload(name, seed=1, context_tokens=context, tokens_per_word=tpw)
    for _ in range(200):
        spec = w.next()
        assert spec.max_tokens >= 1
        assert spec.prompt_words * tpw + spec.max_tokens <= context


def test_chat_mix_varies_lengths_and_apis() -> None:
    w = make_workload("chat", seed=0)
    specs = [w.next() for _ in range(400)]
    assert {s.api for s in specs} == {"chat", "completions"}
    words = [s.prompt_words for s in specs]
    outs = [s.max_tokens for s in specs]
    assert min(words) < 30 and max(words) > 150
    assert min(outs) < 64 and max(outs) > 160
    assert all(s.cancel_after_chunks is None for s in specs)


def test_agents_share_one_system_prompt() -> None:
    w = make_workload("agents", seed=3)
    specs = [w.next() for _ in range(100)]
    systems = {s.messages[0] for s in specs}
    assert systems == {("system", system_prompt(3))}
    assert 130 <= len(system_prompt(3).split()) <= 200  # ~200 tokens
    questions = {s.messages[1][1] for s in specs}
    assert len(questions) > 50  # each agent asks its own questions
    assert len({q.split(" here")[0] for q in questions}) > 10  # many agents


def test_rag_prompts_are_long() -> None:
    w = make_workload("rag", seed=0, context_tokens=4096)
    spec = w.next()
    assert spec.prompt_words * TOKENS_PER_WORD > 0.4 * 4096
    assert spec.max_tokens <= 96
    assert "[doc 1]" in spec.messages[0][1]


def test_cancel_mix_cancels_a_share() -> None:
    w = make_workload("cancel", seed=0)
    specs = [w.next() for _ in range(1000)]
    cancelled = [s for s in specs if s.cancel_after_chunks is not None]
    assert 0.2 < len(cancelled) / len(specs) < 0.4
    assert all(1 <= s.cancel_after_chunks <= 8 for s in cancelled if s.cancel_after_chunks)
    assert {s.scenario for s in cancelled} == {"cancel"}


def test_fixed_max_tokens_and_bodies() -> None:
    w = make_workload("chat", seed=0, max_tokens=32)
    assert {w.next().max_tokens for _ in range(50)} == {32}
    chat = RequestSpec("chat", "chat", 8, messages=(("user", "hi"),))
    body = chat.body("m", {"ignore_eos": True})
    assert body == {
        "model": "m",
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
        "ignore_eos": True,
    }
    assert chat.path == "/v1/chat/completions"
    comp = RequestSpec("completion", "completions", 8, prompt="hi")
    assert comp.body("m")["prompt"] == "hi" and comp.path == "/v1/completions"


def test_calibration_text() -> None:
    text = calibration_text()
    assert 180 <= len(text.split()) <= 200 and text == calibration_text()


def test_unknown_workload_and_tiny_context() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope")
    with pytest.raises(ValueError, match="context_tokens"):
        make_workload("chat", context_tokens=10)
