"""`kvserve serve` with no model serves the bundled demo model (what `make run` does)."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import openai
import pytest

from kvserve.demo_model import DEMO_MODEL_NAME, bundled_model_calls_tools, corpus
from kvserve.demo_model.tool_call import ToolCall, call_satisfies
from tests.support.cli_server import start_cli_server

QUESTION = "Hotels in Kyoto under $200 with an onsen?"


@pytest.mark.slow
def test_serve_without_a_model_answers_a_streamed_hotel_question() -> None:
    proc, url, _ = start_cli_server(None)
    try:
        models = httpx.get(f"{url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [DEMO_MODEL_NAME]
        body = {
            "model": DEMO_MODEL_NAME,
            "stream": True,
            "temperature": 0,
            "max_tokens": 128,
            "messages": [{"role": "user", "content": QUESTION}],
        }
        text = ""
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[len("data: ") :])["choices"][0]["delta"]
                    text += delta.get("content") or ""
        request = corpus.HotelRequest("Kyoto", "hotel", 200, ("onsen",))
        assert corpus.check_answer(request, text), text
        assert "Kyoto" in text
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.skipif(
    not bundled_model_calls_tools(),
    reason="the bundled checkpoint is not trained for tools (kvserve train-demo --no-tools)",
)
def test_serve_without_a_model_runs_a_tool_loop_with_the_openai_sdk() -> None:
    # The bundled model's template renders tools Hermes-style, so the server reads its
    # calls without --tool-call-parser; the tool itself runs here, over the world model.
    proc, url, _ = start_cli_server(None)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        tools: list[Any] = [corpus.SEARCH_HOTELS_TOOL]
        first = client.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=messages, tools=tools, temperature=0
        ).choices[0]
        assert first.finish_reason == "tool_calls", first.message
        (call,) = first.message.tool_calls or []
        assert call.type == "function" and call.function.name == "search_hotels"
        arguments = json.loads(call.function.arguments)
        request = corpus.HotelRequest("Kyoto", "hotel", 200, ("onsen",))
        assert call_satisfies(request, ToolCall("search_hotels", arguments)), arguments
        result = corpus.search_hotels(arguments, random.Random(0))
        assert corpus.result_listings(result)
        messages += [
            first.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": result},
        ]
        answer = client.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=messages, tools=tools, temperature=0
        ).choices[0]
        assert answer.finish_reason == "stop" and not answer.message.tool_calls
        text = answer.message.content or ""
        # The answer lists the result's places (the model card measures how often).
        assert corpus.check_answer(request, text), text
        assert corpus.parse_answer(text) == corpus.result_listings(result), (result, text)
        # A forced call: the grammar writes the template's "<tool_call>", one token of
        # this tokenizer (an added token that is not special). It failed every such
        # request with a grammar error before the grammar's tokenizer read it as text.
        named: Any = {"type": "function", "function": {"name": "search_hotels"}}
        for choice in ("required", named):
            forced = client.chat.completions.create(
                model=DEMO_MODEL_NAME,
                messages=messages[:1],
                tools=tools,
                tool_choice=choice,
                temperature=0,
            ).choices[0]
            # A named function's call ends with "stop", as OpenAI's does.
            finish = "stop" if choice is named else "tool_calls"
            assert forced.finish_reason == finish, (choice, forced.message)
            (call,) = forced.message.tool_calls or []
            arguments = json.loads(call.function.arguments)
            assert call_satisfies(request, ToolCall("search_hotels", arguments)), arguments
    finally:
        proc.terminate()
        proc.wait(timeout=60)
